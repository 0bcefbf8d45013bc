"""Weight formats: one class per stored layout of a projection, with how it is multiplied.

A projection's weight is held in one of five layouts (jaxllm.models.params); each class
here says how `x @ w` is computed for it, dense and for a mixture of experts' rows grouped
by expert:

- `Dense`: a plain [in, out] array (any float dtype); XLA's dot.
- `ChannelInt8`: int8 values, a float scale per output column (QuantizedWeight, group 0).
- `Blocks`: integer values with a scale (and a min) per group of inputs: int4 / int8 by
  groups, GGUF's Q8_0 / Q4_0 / Q4_1 blocks and a mixed GGUF's gguf_int8
  (QuantizedWeight, group > 0).
- `PallasTiles`: a quantized weight marked for the Pallas weight-only matmul.
- `Panels`: the `cpu` backend's packed panels (PackedWeight), multiplied by the C++
  custom calls of jaxllm/cpu_kernels/dense.cc.

`format_of(w)` looks the class up; jaxllm.models.linear.linear and grouped_linear are a
dispatch to it. A new layout is a new class here (and its packing), not a new branch in
every helper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm import cpu_kernels
from jaxllm.models.params import PackedWeight, QuantizedWeight, Weight
from jaxllm.models.quant import (
    ACTIVATION_MAX,
    dequantize,
    grouped_quantized_activation_matmul,
    quantized_activation_matmul,
)

TARGET = "jaxllm_dense_f32"  # registered by jaxllm.cpu_kernels.load_kernels
TARGET_BF16 = "jaxllm_dense_bf16"  # bfloat16 panels of input pairs; x rounded to bfloat16, float32 sums
TARGET_GROUPED = {jnp.dtype(jnp.float32): "jaxllm_grouped_dense_f32",  # experts' panels stacked, rows by expert
                  jnp.dtype(jnp.bfloat16): "jaxllm_grouped_dense_bf16"}
# quantized experts, by (panel dtype, grouped, mins): int8 per column, Q8_0, Q4_0, Q4_1 (and int4),
# gguf_int8
TARGET_GROUPED_QUANTIZED = {("int8", False, False): "jaxllm_grouped_dense_i8",
                            ("int8", True, False): "jaxllm_grouped_dense_q8_0",
                            ("uint8", True, False): "jaxllm_grouped_dense_q4_0",
                            ("uint8", True, True): "jaxllm_grouped_dense_q4_1",
                            ("int8", True, True): "jaxllm_grouped_dense_q8_mins"}  # a mixed GGUF's experts
TARGET_INT8 = "jaxllm_dense_i8"  # int8 panels, float32 scales per column
TARGET_Q8_0 = "jaxllm_dense_q8_0"  # int8 panels, float32 scales per column and 32 inputs
TARGET_Q4_0 = "jaxllm_dense_q4_0"  # 4-bit panels (nibble - 8), scales as Q8_0's
TARGET_Q4_1 = "jaxllm_dense_q4_1"  # 4-bit panels, scales and mins as Q8_0's scales
TARGET_Q8_MINS = "jaxllm_dense_q8_mins"  # int8 panels, scales and mins per 16 (or 2^n) inputs: mixed GGUF
# int8 (int16) activations, panels in the dot layout, by (activations, panel dtype, mins): Q4_0, Q4_1 (int4), Q8_0
_X_FORMATS = {("uint8", False): "q4_0", ("uint8", True): "q4_1", ("int8", False): "q8_0"}
TARGET_X8 = {(acts, dtype, mins): f"jaxllm_dense_{fmt}_x{acts[3:]}" for acts in ACTIVATION_MAX
             for (dtype, mins), fmt in _X_FORMATS.items()}
TARGET_GROUPED_X8 = {key: target.replace("dense", "grouped_dense") for key, target in TARGET_X8.items()}


class Dense:
    """A plain [in, out] array. A weight of another dtype than `x` (bfloat16 weights under
    float32 activations: jaxllm.platform.activation_dtype) multiplies `x` rounded to the
    weight's dtype, accumulating and returning `x`'s dtype (or `preferred_element_type`)."""

    @staticmethod
    def holds(w) -> bool:
        return not isinstance(w, (QuantizedWeight, PackedWeight))

    @staticmethod
    def matmul(x: Float[Array, "... K"], w, preferred_element_type=None, rows=None) -> Float[Array, "... N"]:
        if w.dtype != x.dtype:
            return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=preferred_element_type or x.dtype)
        return jnp.matmul(x, w, preferred_element_type=preferred_element_type)

    @staticmethod
    def grouped_matmul(x: Float[Array, "M K"], w, group_sizes: Int[Array, " E"]) -> Float[Array, "M N"]:
        """`jax.lax.ragged_dot`: a grouped matmul on a GPU (XLA:CPU computes every expert
        for every row)."""
        return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32)


class _Quantized:
    """A QuantizedWeight (weight-only: jaxllm.models.quant): multiplied with its inputs
    quantized to int8 / int16 per 32 where its `activations` say so, else as the float
    matrix it stands for (`float_matmul`, per layout)."""

    @classmethod
    def matmul(cls, x: Float[Array, "... K"], w: QuantizedWeight, preferred_element_type=None, rows=None
               ) -> Float[Array, "... N"]:
        if w.activations != "float":
            y = quantized_activation_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])
            return y.astype(preferred_element_type or jnp.float32)
        return cls.float_matmul(x, w, preferred_element_type)

    @staticmethod
    def grouped_matmul(x: Float[Array, "M K"], w: QuantizedWeight, group_sizes: Int[Array, " E"]
                       ) -> Float[Array, "M N"]:
        """The experts dequantized (the kernel converts them panel by panel), or with
        quantized activations their integer dot products."""
        if w.activations != "float":
            return grouped_quantized_activation_matmul(x, w, group_sizes.astype(jnp.int32))
        return Dense.grouped_matmul(x, dequantize(w), group_sizes)


class ChannelInt8(_Quantized):
    """int8 values, a float scale per output column: the int8 values (exact in any float
    dtype) multiplied, the output columns scaled."""

    @staticmethod
    def holds(w) -> bool:
        return isinstance(w, QuantizedWeight) and w.kernel != "pallas" and not w.group

    @staticmethod
    def float_matmul(x: Float[Array, "... K"], w: QuantizedWeight, preferred_element_type=None
                     ) -> Float[Array, "... N"]:
        y = jnp.matmul(x, w.q.astype(x.dtype), preferred_element_type=preferred_element_type or x.dtype)
        return y * w.scale.astype(y.dtype)


class Blocks(_Quantized):
    """Integer values with a scale (and a min) per group of inputs (int4 / int8 by groups,
    GGUF's blocks): dequantized first (the `cpu` kernel does it in registers: Panels); one
    of a bfloat16 model (`float_dtype`) multiplies as the model's plain bfloat16 weights
    would."""

    @staticmethod
    def holds(w) -> bool:
        return isinstance(w, QuantizedWeight) and w.kernel != "pallas" and bool(w.group)

    @staticmethod
    def float_matmul(x: Float[Array, "... K"], w: QuantizedWeight, preferred_element_type=None
                     ) -> Float[Array, "... N"]:
        if w.float_dtype != "float32":  # the plain weight it stands for
            return Dense.matmul(x, dequantize(w), preferred_element_type)
        return jnp.matmul(x, dequantize(w).astype(x.dtype), preferred_element_type=preferred_element_type)


class PallasTiles(_Quantized):
    """A quantized weight marked for the `pallas` backend: the Pallas weight-only matmul
    (pallas_kernels.quantized_matmul: int8 tiles dequantized in the kernel; interpret
    mode off GPU)."""

    @staticmethod
    def holds(w) -> bool:
        return isinstance(w, QuantizedWeight) and w.kernel == "pallas"

    @staticmethod
    def matmul(x: Float[Array, "... K"], w: QuantizedWeight, preferred_element_type=None, rows=None
               ) -> Float[Array, "... N"]:
        from pallas_kernels.quantized_matmul import quantized_matmul

        lead = x.shape[:-1]
        y = quantized_matmul(x.reshape(-1, x.shape[-1]), w.q, w.scale, w.mins, group=w.group,
                             out_dtype=preferred_element_type, interpret=jax.default_backend() != "gpu")
        return y.reshape(*lead, w.shape[1])


class Panels:
    """The `cpu` backend's packed panels (PackedWeight), multiplied by the C++ custom calls
    (float32 results: x multiplied in float32, or rounded to bfloat16 for bfloat16
    panels). `rows` (x [T, K]): only x's first `rows` rows are multiplied, the rest of y
    is zeros (the grouped kernel over one expert of `rows` rows: the same sums as the
    dense call's)."""

    @staticmethod
    def holds(w) -> bool:
        return isinstance(w, PackedWeight)

    @staticmethod
    def matmul(x: Float[Array, "... K"], w: PackedWeight, preferred_element_type=None,
               rows: Int[Array, ""] | None = None) -> Float[Array, "... N"]:
        cpu_kernels.load_kernels()  # registers the custom calls (once)
        if rows is not None and x.ndim == 2 and not w.experts:
            return Panels.grouped_matmul(x, one_expert(w), jnp.reshape(rows, (1,)))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        return Panels._dense_call(x2, w, jax.ShapeDtypeStruct((x2.shape[0], w.out_features), jnp.float32)
                                  ).reshape(*lead, w.out_features)

    @staticmethod
    def _dense_call(x2: Float[Array, "M K"], w: PackedWeight, out: jax.ShapeDtypeStruct) -> Float[Array, "M N"]:
        """The dense handler the panels' layout picks."""
        if w.activations != "float":
            return _x8_call(TARGET_X8, x2, w, out)
        # grouped panels: x and the dequantized weights rounded to bfloat16 (`bf16`), by the tiles `bf16_dot` says
        bf16 = dict(bf16=w.float_dtype == "bfloat16", bf16_dot=w.bf16_dot)
        if w.mins is not None:
            target = TARGET_Q4_1 if w.panels.dtype == jnp.uint8 else TARGET_Q8_MINS
            return jax.ffi.ffi_call(target, out)(x2, w.panels, w.scale, w.mins, **bf16)
        if w.scale is not None and w.group:
            target = TARGET_Q4_0 if w.panels.dtype == jnp.uint8 else TARGET_Q8_0
            return jax.ffi.ffi_call(target, out)(x2, w.panels, w.scale, **bf16)
        if w.scale is not None:
            return jax.ffi.ffi_call(TARGET_INT8, out)(x2, w.panels, w.scale)
        if w.panels.dtype == jnp.bfloat16:
            return jax.ffi.ffi_call(TARGET_BF16, out)(x2.astype(jnp.float32), w.panels, bf16_dot=w.bf16_dot)
        return jax.ffi.ffi_call(TARGET, out)(x2.astype(jnp.float32), w.panels)

    @staticmethod
    def grouped_matmul(x: Float[Array, "M K"], w: PackedWeight, group_sizes: Int[Array, " E"]
                       ) -> Float[Array, "M N"]:
        """The dense kernel over each group's rows (the work follows the rows)."""
        cpu_kernels.load_kernels()
        out = jax.ShapeDtypeStruct((x.shape[0], w.out_features), jnp.float32)
        x, sizes = x.astype(jnp.float32), group_sizes.astype(jnp.int32)
        if w.activations != "float":
            return _x8_call(TARGET_GROUPED_X8, x, w, out, sizes)
        if w.scale is None:
            attrs = dict(bf16_dot=w.bf16_dot) if w.panels.dtype == jnp.bfloat16 else {}
            return jax.ffi.ffi_call(TARGET_GROUPED[jnp.dtype(w.panels.dtype)], out)(x, w.panels, sizes, **attrs)
        target = TARGET_GROUPED_QUANTIZED[(jnp.dtype(w.panels.dtype).name, bool(w.group), w.mins is not None)]
        scales = (w.scale,) if w.mins is None else (w.scale, w.mins)
        attrs = dict(bf16=w.float_dtype == "bfloat16", bf16_dot=w.bf16_dot) if w.group else {}
        return jax.ffi.ffi_call(target, out)(x, w.panels, *scales, sizes, **attrs)


FORMATS = (Dense, ChannelInt8, Blocks, PallasTiles, Panels)


def format_of(w: Weight | Float[Array, "E K N"]):
    """The class of `w`'s stored layout (exactly one holds it); a mixture of experts'
    weights are [E, K, N]."""
    return next(f for f in FORMATS if f.holds(w))


def one_expert(w: PackedWeight) -> PackedWeight:
    """A dense packed weight as a mixture of one expert (a leading axis of 1: a
    reshape, no copy), for the grouped kernel's row count."""
    lead = lambda a: None if a is None else a[None]
    return w.replace(panels=w.panels[None], scale=lead(w.scale), mins=lead(w.mins), experts=1)


def _x8_call(targets: dict, x: Float[Array, "M K"], w: PackedWeight, out: jax.ShapeDtypeStruct, *extra):
    """x (float32) times dot-layout panels through the int8- (int16-) activation handler
    of `targets` their format picks (a mixture's: `extra` = the group sizes)."""
    mins = () if w.mins is None else (w.mins,)
    target = targets[(w.activations, jnp.dtype(w.panels.dtype).name, w.mins is not None)]
    return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), w.panels, w.scale, *mins, *extra)
