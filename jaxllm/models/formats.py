"""Weight formats: one class per stored layout of a projection, with how it is multiplied.

A projection's weight is held in one of six layouts (jaxllm.models.params); each class
here says how `x @ w` is computed for it, dense and for a mixture of experts' rows grouped
by expert, and (the layouts the `cpu` backend packs) how it becomes panels:

- `Dense`: a plain [in, out] array (any float dtype); XLA's dot.
- `ChannelInt8`: int8 values, a float scale per output column (QuantizedWeight, group 0).
- `Blocks`: integer values with a scale (and a min) per group of inputs: int4 / int8 by
  groups, GGUF's Q8_0 / Q4_0 / Q4_1 blocks and a mixed GGUF's gguf_int8
  (QuantizedWeight, group > 0).
- `PallasTiles`: a quantized weight marked for the Pallas weight-only matmul.
- `MosaicTiles`: one held for the Mosaic GPU weight-only matmul on a Hopper (values
  transposed).
- `Panels`: the `cpu` backend's packed panels (PackedWeight), multiplied by the C++
  custom calls of jaxllm/cpu_kernels/dense.cc.

`format_of(w)` looks the class of a held weight up; jaxllm.models.linear's linear,
grouped_linear, pack_weight, unpack_weight and packed_rows are a dispatch to it.
`declared_format(decl)` looks up the class a parameter's declaration (ParamDecl) loads
in (Dense, ChannelInt8 or Blocks), which says how it is sharded (`partition_spec`:
jaxllm.models.parallel) and described (`describe`: the engine's start-up line); the
backends' own layouts (PallasTiles, Panels) are made from it. A new layout is a new
class here, not a new branch in every helper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, Shaped

from jaxllm import cpu_kernels
from jaxllm.models.params import (
    BF16_TILES,
    PANEL,
    QUANT_FORMATS,
    PackedWeight,
    ParamDecl,
    QuantizedWeight,
    ShardingRules,
    quantized_layout,
)
from jaxllm.models.quant import (
    ACTIVATION_MAX,
    dequantize,
    grouped_quantized_activation_matmul,
    quantized_activation_matmul,
)
from jaxllm.platform import targets_gpu

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
# a gated MLP's [gate | up] panels giving act(gate) * up (AMX's tiles): bfloat16 panels, Q4_1 blocks
TARGET_GATED = {"bfloat16": "jaxllm_grouped_dense_bf16_gated", "uint8": "jaxllm_grouped_dense_q4_1_gated"}
GATED_MIN_ROWS = 8  # fewer rows: the plain projection, then the activation (as fast at 1 row; docs/cpu_kernels.md)
TARGET_INT8 = "jaxllm_dense_i8"  # int8 panels, float32 scales per column
TARGET_Q8_0 = "jaxllm_dense_q8_0"  # int8 panels, float32 scales per column and 32 inputs
TARGET_Q4_0 = "jaxllm_dense_q4_0"  # 4-bit panels (nibble - 8), scales as Q8_0's
TARGET_Q4_1 = "jaxllm_dense_q4_1"  # 4-bit panels, scales and mins as Q8_0's scales
TARGET_Q8_MINS = "jaxllm_dense_q8_mins"  # int8 panels, scales and mins per 16 (or 2^n) inputs: mixed GGUF
# int8 (int16) activations, panels in the dot layout, by (activations, panel dtype, mins): Q4_0, Q4_1 (int4), Q8_0
_X_FORMATS = {("uint8", False): "q4_0", ("uint8", True): "q4_1", ("int8", False): "q8_0"}
TARGET_X8 = {(acts, dtype, mins): f"jaxllm_dense_{fmt}_x{acts[3:]}" for acts in ACTIVATION_MAX
             for (dtype, mins), fmt in _X_FORMATS.items()}
# bfloat16 activations over the same dot layout (PackedWeight.activations "bfloat16": a step's mark)
TARGET_X8.update({("bfloat16", dtype, mins): f"jaxllm_dense_{fmt}_xbf16" for (dtype, mins), fmt in _X_FORMATS.items()})
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
    def partition_spec(decl: ParamDecl, rules: ShardingRules) -> P:
        """Each logical axis mapped to a mesh axis by `rules` (unnamed: replicated)."""
        return _axes_spec(decl.axes, rules)

    @staticmethod
    def describe(decl: ParamDecl) -> str:
        return "float"

    @staticmethod
    def grouped_matmul(x: Float[Array, "M K"], w, group_sizes: Int[Array, " E"]) -> Float[Array, "M N"]:
        """`jax.lax.ragged_dot`: a grouped matmul on a GPU (XLA:CPU computes every expert
        for every row)."""
        return jax.lax.ragged_dot(x.astype(w.dtype), w, group_sizes, preferred_element_type=jnp.float32)

    @staticmethod
    def pack(w: Shaped[Array, "*E K N"] | Shaped[np.ndarray, "*E K N"] | jax.ShapeDtypeStruct) -> PackedWeight:
        """Panels of PANEL columns, [out/PANEL, in, PANEL], the last zero-padded (bfloat16:
        input pairs side by side, [out/PANEL, in/2, PANEL, 2]); a mixture's experts each
        packed and stacked; abstract panels for an abstract `w`."""
        if len(w.shape) == 3:  # a mixture of experts' [E, K, N]: each expert's panels, stacked
            if isinstance(w, jax.ShapeDtypeStruct):
                one = Dense.pack(jax.ShapeDtypeStruct(w.shape[1:], w.dtype))
                stacked = jax.ShapeDtypeStruct((w.shape[0], *one.panels.shape), w.dtype)
                return one.replace(panels=stacked, experts=w.shape[0])
            packed = [Dense.pack(w[e]) for e in range(w.shape[0])]
            return packed[0].replace(panels=jnp.stack([p.panels for p in packed]), experts=w.shape[0])
        k, n = w.shape
        pairs = jnp.dtype(w.dtype) == jnp.bfloat16
        if isinstance(w, jax.ShapeDtypeStruct):
            shape = (-(-n // PANEL), -(-k // 2), PANEL, 2) if pairs else (-(-n // PANEL), k, PANEL)
            return PackedWeight(jax.ShapeDtypeStruct(shape, w.dtype), n)
        # on the host (numpy: a view of a CPU array), or traced (a trainer's forward under
        # jit: jaxllm.models.dense's batch-invariant one packs as it goes)
        traced = isinstance(w, jax.core.Tracer)
        xp, contiguous = (jnp, jnp.asarray) if traced else (np, np.ascontiguousarray)
        a = xp.asarray(w)
        if n % PANEL or (pairs and k % 2):
            a = xp.pad(a, ((0, k % 2 if pairs else 0), (0, -n % PANEL)))
        if pairs:  # [K, N] -> [N/32, K/2, 32, 2]: the two inputs of a pair side by side (vdpbf16ps)
            return PackedWeight(jnp.asarray(contiguous(a.reshape(-1, 2, a.shape[1] // PANEL, PANEL)
                                                       .transpose(2, 0, 3, 1))), n)
        return PackedWeight(jnp.asarray(contiguous(a.reshape(k, -1, PANEL).transpose(1, 0, 2))), n)


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

    @staticmethod
    def pack(w: QuantizedWeight) -> PackedWeight:
        """Integer panels (4-bit values two to a byte), the scales and mins zero-padded to
        their columns; a mixture's experts each packed and stacked."""
        return _pack_quantized_experts(w) if len(w.shape) == 3 else _pack_quantized(w)

    @classmethod
    def partition_spec(cls, decl: ParamDecl, rules: ShardingRules) -> QuantizedWeight:
        """A QuantizedWeight of PartitionSpecs: the values as a float weight's, the scales
        (and mins) split with the axis they run along (`scale_spec`)."""
        if decl.act_order:  # the inputs' permutation crosses any split of them
            raise ValueError(f"{decl.hf[0][0]}: a checkpoint quantized in activation order (desc_act) is not "
                             f"sharded for tensor parallelism; quantization='none' dequantizes it at load")
        whole, scale = _axes_spec(decl.axes, rules), cls.scale_spec(decl, rules)
        return QuantizedWeight(whole, scale, mins=scale if QUANT_FORMATS[decl.quant].mins else None,
                               **quantized_layout(decl))


class ChannelInt8(_Quantized):
    """int8 values, a float scale per output column: the int8 values (exact in any float
    dtype) multiplied, the output columns scaled."""

    @staticmethod
    def holds(w) -> bool:
        return isinstance(w, QuantizedWeight) and not w.kernel and not w.group

    @staticmethod
    def scale_spec(decl: ParamDecl, rules: ShardingRules) -> P:
        """[.., N]: a mixture's experts, then the columns."""
        return _axes_spec((*decl.axes[:-2], decl.axes[-1]), rules)

    @staticmethod
    def describe(decl: ParamDecl) -> str:
        return f"{decl.quant} per column"

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
        return isinstance(w, QuantizedWeight) and not w.kernel and bool(w.group)

    @staticmethod
    def scale_spec(decl: ParamDecl, rules: ShardingRules) -> P:
        """[K / group, N] ([V, D / group]): the groups split with their axis, as the values
        do (jaxllm.models.parallel refuses a split inside a group)."""
        return _axes_spec(decl.axes, rules)

    @staticmethod
    def describe(decl: ParamDecl) -> str:
        return f"{decl.quant} in blocks of {QUANT_FORMATS[decl.quant].group}"

    @staticmethod
    def float_matmul(x: Float[Array, "... K"], w: QuantizedWeight, preferred_element_type=None
                     ) -> Float[Array, "... N"]:
        if w.float_dtype != "float32":  # the plain weight it stands for
            return Dense.matmul(x, dequantize(w), preferred_element_type)
        return jnp.matmul(x, dequantize(w).astype(x.dtype), preferred_element_type=preferred_element_type)


class PallasTiles(_Quantized):
    """A quantized weight marked for the `pallas` backend: the Pallas weight-only matmul
    (pallas_kernels.quantized_matmul: int8 tiles dequantized in the kernel; interpret
    mode where no GPU is the target)."""

    kernel = "pallas"

    @classmethod
    def holds(cls, w) -> bool:
        return isinstance(w, QuantizedWeight) and w.kernel == cls.kernel

    @classmethod
    def matmul(cls, x: Float[Array, "... K"], w: QuantizedWeight, preferred_element_type=None, rows=None
               ) -> Float[Array, "... N"]:

        y = cls.call(x.reshape(-1, x.shape[-1]), w, out_dtype=preferred_element_type, interpret=not targets_gpu())
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def call(x: Float[Array, "M K"], w: QuantizedWeight, **kw) -> Float[Array, "M N"]:
        from pallas_kernels.quantized_matmul import quantized_matmul

        return quantized_matmul(x, w.q, w.scale, w.mins, group=w.group, **kw)


class MosaicTiles(PallasTiles):
    """A quantized weight held for the Mosaic GPU weight-only matmul on a Hopper
    (jaxllm.models.linear.mosaic_weight): its values transposed, [N, K] (K-major, as the
    kernel's TMA reads a tile of output rows), scales and mins as they were."""

    kernel = "mosaic"

    @staticmethod
    def call(x: Float[Array, "M K"], w: QuantizedWeight, **kw) -> Float[Array, "M N"]:
        from pallas_kernels.quantized_matmul_mgpu import quantized_matmul_mgpu

        return quantized_matmul_mgpu(x, w.q, w.scale, w.mins, group=w.group, **kw)


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
        # grouped panels: x and the dequantized weights rounded to bfloat16 (`bf16`), by the tiles `bf16_tiles` says
        bf16 = dict(bf16=w.float_dtype == "bfloat16", bf16_tiles=_tiles(w))
        if w.mins is not None:
            target = TARGET_Q4_1 if w.panels.dtype == jnp.uint8 else TARGET_Q8_MINS
            return jax.ffi.ffi_call(target, out)(x2, w.panels, w.scale, w.mins, **bf16)
        if w.scale is not None and w.group:
            target = TARGET_Q4_0 if w.panels.dtype == jnp.uint8 else TARGET_Q8_0
            return jax.ffi.ffi_call(target, out)(x2, w.panels, w.scale, **bf16)
        if w.scale is not None:
            return jax.ffi.ffi_call(TARGET_INT8, out)(x2, w.panels, w.scale)
        if w.panels.dtype == jnp.bfloat16:
            return jax.ffi.ffi_call(TARGET_BF16, out)(x2.astype(jnp.float32), w.panels, bf16_tiles=_tiles(w))
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
            attrs = dict(bf16_tiles=_tiles(w)) if w.panels.dtype == jnp.bfloat16 else {}
            return jax.ffi.ffi_call(TARGET_GROUPED[jnp.dtype(w.panels.dtype)], out)(x, w.panels, sizes, **attrs)
        target = TARGET_GROUPED_QUANTIZED[(jnp.dtype(w.panels.dtype).name, bool(w.group), w.mins is not None)]
        scales = (w.scale,) if w.mins is None else (w.scale, w.mins)
        attrs = dict(bf16=w.float_dtype == "bfloat16", bf16_tiles=_tiles(w)) if w.group else {}
        return jax.ffi.ffi_call(target, out)(x, w.panels, *scales, sizes, **attrs)

    @staticmethod
    def gates(w, rows: int) -> bool:
        """Whether `w`, a gated MLP's [gate | up] projection of `rows` rows, gives act(gate) *
        up itself (gated_matmul): bfloat16 panels or Q4_1 blocks in bfloat16 on AMX's tiles,
        whole panels of gate and of up, and rows enough for the sums' memory traffic it
        saves to outweigh the activation it adds to each item."""
        if not isinstance(w, PackedWeight) or w.experts or w.perm is not None or w.activations != "float":
            return False
        kind = jnp.dtype(w.panels.dtype).name
        q4_1 = kind == "uint8" and w.mins is not None and w.group and w.float_dtype == "bfloat16"
        plain = kind == "bfloat16" and w.scale is None
        return ((q4_1 or plain) and w.bf16_tiles == "amx" and w.out_features % (2 * PANEL) == 0
                and rows >= GATED_MIN_ROWS and cpu_kernels.has_amx())

    @staticmethod
    def gated_matmul(x: Float[Array, "T K"], w: PackedWeight, act: str, rows: Int[Array, ""] | None = None
                     ) -> Float[Array, "T F"]:
        """act(gate) * up of x @ w for `w` that `gates` (SiLU for "silu", else GELU's tanh
        form, as moe.gated), float32; `rows` as matmul's."""
        cpu_kernels.load_kernels()
        w1 = one_expert(w)
        sizes = jnp.reshape(x.shape[0] if rows is None else rows, (1,)).astype(jnp.int32)
        out = jax.ShapeDtypeStruct((x.shape[0], w.out_features // 2), jnp.float32)
        kind = jnp.dtype(w.panels.dtype).name
        attrs = dict(bf16_tiles=_tiles(w), act=np.int32(0 if act == "silu" else 1))
        call = jax.ffi.ffi_call(TARGET_GATED[kind], out)
        if kind == "bfloat16":
            return call(x.astype(jnp.float32), w1.panels, sizes, **attrs)
        return call(x.astype(jnp.float32), w1.panels, w1.scale, w1.mins, sizes, bf16=True, **attrs)

    @staticmethod
    def unpack(w: PackedWeight) -> Float[Array, "K N"] | Float[Array, "E K N"]:
        """The [in, out] matrix back, dequantized (tests and debugging); a mixture of
        experts' [E, in, out]."""
        if w.experts:
            expert = lambda a, e: None if a is None else a[e]
            return jnp.stack([Panels.unpack(w.replace(panels=w.panels[e], scale=expert(w.scale, e),
                                                      mins=expert(w.mins, e), experts=0)) for e in range(w.experts)])
        panels = w.panels
        if w.activations != "float" and panels.dtype == jnp.int8:  # the dot layout [P, K/4, 32, 4] -> [P, K, 32]
            panels = panels.transpose(0, 1, 3, 2).reshape(panels.shape[0], -1, PANEL)
        elif w.activations != "float":  # the dot layout [P, K/8, 32, 4] -> [P, K, 16]
            lo_hi = jnp.stack([panels & 0x0F, panels >> 4], axis=2).transpose(0, 1, 2, 4, 3)  # [P, K/8, 2, 4, 32]
            v = lo_hi.reshape(panels.shape[0], -1, PANEL)
            panels = (v[..., : PANEL // 2] | (v[..., PANEL // 2:] << 4)).astype(jnp.uint8)
        elif panels.ndim == 4:  # bfloat16 pairs [P, K/2, 32, 2] -> [P, K (even), 32]
            panels = panels.transpose(0, 1, 3, 2).reshape(panels.shape[0], -1, PANEL)
        if panels.dtype == jnp.uint8:  # 4-bit: the nibbles back as values (minus 8 without mins)
            panels = jnp.concatenate([panels & 0x0F, panels >> 4], axis=-1).astype(jnp.int8)
            panels = panels if w.mins is not None else panels - 8
        matrix = panels.transpose(1, 0, 2).reshape(w.in_features, -1)
        if w.scale is not None and w.group:
            by_group = lambda a: a.transpose(1, 0, 2).reshape(a.shape[1], -1)
            mins = None if w.mins is None else by_group(w.mins)
            matrix = dequantize(QuantizedWeight(matrix, by_group(w.scale), w.group, mins, float_dtype=w.float_dtype))
        elif w.scale is not None:
            matrix = matrix.astype(jnp.float32) * w.scale
        return matrix[:, : w.out_features]

    @staticmethod
    def take_rows(w: PackedWeight, rows: Int[Array, " T"]) -> Float[Array, "T K"]:
        """Rows `rows` of the [out, in] matrix a packed output projection transposes: the
        embedding rows of a tied model, looked up from its packed head (one copy of the
        table). Each row is the value the unpacked table's lookup gives (a quantized one's
        dequantized as `dequantize(take_rows)` does), gathered from whichever layout."""
        panel, col = rows // PANEL, rows % PANEL
        panels = w.panels
        if w.activations != "float" and panels.dtype == jnp.int8:  # [P, K/4, 32, 4]
            q = panels[panel, :, col, :].reshape(rows.shape[0], -1)
        elif w.activations != "float":  # [P, K/8, 32, 4]: byte j holds inputs 8i + j (low) and 8i + 4 + j (high)
            b = panels[panel, :, col, :]
            q = jnp.concatenate([b & 0x0F, b >> 4], axis=-1).reshape(rows.shape[0], -1)
        elif panels.ndim == 4:  # bfloat16 pairs [P, K/2, 32, 2]
            q = panels[panel, :, col, :].reshape(rows.shape[0], -1)
        elif panels.dtype == jnp.uint8:  # [P, K, 16]: column c in byte c % 16, low half for c < 16
            b = panels[panel, :, col % (PANEL // 2)]
            q = jnp.where((col < PANEL // 2)[:, None], b & 0x0F, b >> 4)
        else:
            q = panels[panel, :, col]
        if w.scale is None:
            return q
        if panels.dtype == jnp.uint8:
            q = q.astype(jnp.int8) - (0 if w.mins is not None else 8)  # Q4_0's stored nibble is the value + 8
        if not w.group:  # per column of the head: per row of the table
            return q.astype(jnp.float32) * w.scale[rows][:, None]
        mins = None if w.mins is None else w.mins[panel, :, col]
        table = QuantizedWeight(q.astype(jnp.int8), w.scale[panel, :, col], w.group, mins, group_axis=1,
                                float_dtype=w.float_dtype)
        return dequantize(table)


FORMATS = (Dense, ChannelInt8, Blocks, PallasTiles, MosaicTiles, Panels)


def format_of(w):
    """The class of `w`'s stored layout (exactly one holds it): arrays, numpy arrays and
    abstract ones (jax.ShapeDtypeStruct) too; a mixture of experts' weights are [E, K, N]."""
    return next(f for f in FORMATS if f.holds(w))


def declared_format(decl: ParamDecl) -> type[Dense | ChannelInt8 | Blocks]:
    """The class of the layout `decl` is loaded in: Dense unless it is declared quantized
    (then by its QUANT_FORMATS entry). A backend's own layouts (PallasTiles, Panels) are
    made from it by the model runner (jaxllm.worker.model_runner.layout_params)."""
    if not decl.quant:
        return Dense
    return Blocks if QUANT_FORMATS[decl.quant].group else ChannelInt8


def _axes_spec(axes: tuple[str | None, ...], rules: ShardingRules) -> P:
    return P(*(rules.get(a) for a in axes))


def one_expert(w: PackedWeight) -> PackedWeight:
    """A dense packed weight as a mixture of one expert (a leading axis of 1: a
    reshape, no copy), for the grouped kernel's row count."""
    lead = lambda a: None if a is None else a[None]
    return w.replace(panels=w.panels[None], scale=lead(w.scale), mins=lead(w.mins), experts=1)


def _tiles(w: PackedWeight) -> np.int32:
    """The kernel's `bf16_tiles` attribute for `w` (dense.cc's BF16Tiles)."""
    return np.int32(BF16_TILES.index(w.bf16_tiles))


def _x8_call(targets: dict, x: Float[Array, "M K"], w: PackedWeight, out: jax.ShapeDtypeStruct, *extra):
    """x (float32) times dot-layout panels through the int8- (int16-, bfloat16-)
    activation handler of `targets` their format picks (a mixture's: `extra` = the
    group sizes); bfloat16 ones summed by the tiles `bf16_tiles` names."""
    mins = () if w.mins is None else (w.mins,)
    key = (w.activations, jnp.dtype(w.panels.dtype).name, w.mins is not None)
    if key not in targets:
        raise ValueError(f"dot-layout panels: no {w.activations} activations for {key[1]} panels")
    attrs = dict(bf16_tiles=_tiles(w)) if w.activations == "bfloat16" else {}
    return jax.ffi.ffi_call(targets[key], out)(x.astype(jnp.float32), w.panels, w.scale, *mins, *extra, **attrs)


def _pack_quantized_experts(w: QuantizedWeight) -> PackedWeight:
    """A mixture of experts' quantized [E, K, N]: each expert packed, stacked."""
    e = w.shape[0]
    if isinstance(w.q, jax.ShapeDtypeStruct):
        one = _pack_quantized(w.map_arrays(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)))
        stacked = lambda a: None if a is None else jax.ShapeDtypeStruct((e, *a.shape), a.dtype)
        return one.replace(panels=stacked(one.panels), scale=stacked(one.scale), mins=stacked(one.mins), experts=e)
    packed = [_pack_quantized(w.expert(i)) for i in range(e)]

    def stack(name: str):
        return None if getattr(packed[0], name) is None else jnp.stack([getattr(p, name) for p in packed])

    return packed[0].replace(panels=stack("panels"), scale=stack("scale"), mins=stack("mins"), experts=e)


def _pack_quantized(w: QuantizedWeight) -> PackedWeight:
    values = Dense.pack(w.q)
    p = values.panels.shape[0]
    groups = w.scale.shape[:-1]  # () per column, (K / group,) per block of inputs
    if w.bits == 4:
        values = values.replace(panels=_nibble_panels(values.panels, offset=0 if w.mins is not None else 8,
                                                      dot=w.activations != "float"))
    elif w.activations != "float":  # [P, K, 32] -> [P, K/4, 32, 4]: input 4i + j as byte j of its column
        k = values.panels.shape[1]
        if isinstance(values.panels, jax.ShapeDtypeStruct):
            values = values.replace(panels=jax.ShapeDtypeStruct((p, k // 4, PANEL, 4), jnp.int8))
        else:
            v = np.asarray(values.panels).reshape(p, k // 4, 4, PANEL)
            values = values.replace(panels=jnp.asarray(np.ascontiguousarray(v.transpose(0, 1, 3, 2))))

    def padded(scale):
        if isinstance(scale, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((p, *groups, PANEL) if groups else (p * PANEL,), scale.dtype)
        scale = np.asarray(scale)
        scale = np.pad(scale, [(0, 0)] * len(groups) + [(0, p * PANEL - scale.shape[-1])])
        if groups:  # [G, P * 32] -> [P, G, 32]: a panel's scales next to its values
            scale = np.ascontiguousarray(scale.reshape(groups[0], p, PANEL).transpose(1, 0, 2))
        return jnp.asarray(scale)

    return values.replace(scale=padded(w.scale), group=w.group, mins=None if w.mins is None else padded(w.mins),
                          float_dtype=w.float_dtype, activations=w.activations, perm=w.perm)


def _nibble_panels(panels, offset: int, dot: bool):
    """4-bit values' panels [P, K, 32] (int8, plus `offset`: Q4_0's 8) two to a byte:
    [P, K, 16], byte j holding column j low and column j + 16 high; or with `dot` (int8
    or int16 activations) [P, K/8, 32, 4], byte j of column c at inputs 8i.. holding input 8i + j
    low and 8i + 4 + j high (the 4 inputs an integer dot product sums per 32-bit lane).
    Abstract panels too."""
    p, k, _ = panels.shape
    if isinstance(panels, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((p, k // 8, PANEL, 4) if dot else (p, k, PANEL // 2), jnp.uint8)
    nibbles = np.asarray(panels).astype(np.uint8) + np.uint8(offset)
    if dot:  # [P, K/8, 2 (low, high), 4, 32] -> [P, K/8, 32, 4]
        v = nibbles.reshape(p, k // 8, 2, 4, PANEL)
        return jnp.asarray(np.ascontiguousarray((v[:, :, 0] | (v[:, :, 1] << 4)).transpose(0, 1, 3, 2)))
    half = PANEL // 2
    return jnp.asarray((nibbles[..., :half] & 0x0F) | (nibbles[..., half:] << 4))
