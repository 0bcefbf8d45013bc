"""Weight-only quantization of the projections, as their declaration says
(jaxllm.models.params: `ParamDecl.quant`, set from `ModelConfig.quantization`).

`int8`: symmetric, a float32 scale per output column, `scale = max|w[:, n]| / 127`,
`q = round(w / scale)` (half to even), so that `w ~ q * scale` within half a step of
the scale. A projection then reads 1 byte a weight instead of 4 (float32) or 2
(bfloat16); `linear` multiplies `x @ q` and scales the columns after the dot, which is
exact reassociation (the scale is per column), so the XLA path is `x @ dequantize(w)`
up to the dot's own rounding.

`q8_0`, `q4_0`, `q4_1`: GGUF's block formats, a float16 scale per 32 inputs of each
column (gguf's own quantizer), held as int8 values and float16 scales [K / 32, N]: Q8_0
values in [-127, 127], Q4_0 in [-8, 7] (the stored nibble minus 8), Q4_1 in [0, 15]
with a float16 min per block as well (w = d * q + m). A GGUF whose projections are all
of one of these keeps its blocks (jaxllm.loaders.gguf_loader). Each weight is what
gguf dequantizes it to, `q * scale` rounded once (then `+ min`, rounded again: never a
fused multiply-add), so the kernel's sums are those of the dequantized matrix.

`int4` / `int4_g32`: 4-bit values with a float32 scale and min per 128 (32) inputs of
each column, quantized at load from float weights (asymmetric, as AWQ/GPTQ's group-wise
int4 with the zero point kept as a float min): 4.5 (6) bits a weight; the kernel's
4-bit panels run them as Q4_1's.

`gguf_int8`: a GGUF whose projections mix block types (Q4_K_M files: Q4_K, Q6_K, Q5_0,
Q8_0...) keeps each weight exactly as gguf dequantizes it, as int8 values with a float32
scale and min per 16 inputs (12 bits a weight against float32's 32); only a GGUF's own.
A projection of such a file whose parts are all of types a tighter container holds
exactly is held in that one instead (`mixed_gguf_format`: Q4_K as int4_g32, Q5_0 and
Q8_0 as q8_0...; `ModelConfig.tensor_quantization` lists them).

The embedding (a lookup) and the norms stay as loaded, as in vLLM's weight-only
schemes; so does a tied output projection, which is the embedding.

int8 activations (EngineConfig.activation_quantization="int8", opt-in): the inputs of
each projection kept in blocks of 32 inputs or a multiple (Q4_0, Q4_1, Q8_0, int4,
int4_g32) quantized per row and 32 inputs to int8 with a float32 scale, as llama.cpp
multiplies its blocks (Q8_0 / Q8_1 activations) and vLLM's GGUF kernels too; each
block's integer dot product is exact, then scaled (`quantized_activation_matmul`). The
`cpu` kernel runs it with integer dot-product instructions (jaxllm/cpu_kernels/dense.cc),
trading an error of up to half a step of each block's scale (max |x| / 254) per input
for it. int16 activations ("int16") the same with int16 values: a step of max |x| /
32767 (258 times finer), at half int8's integer rate (vpdpwssd: two products a 32-bit
lane where vpdpbusd makes four).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int32

from jaxllm.config import QUANTIZATIONS, ModelConfig
from jaxllm.models.params import (
    GROUPED_FORMATS,
    QUANT_FORMATS,
    ModelParams,
    ParamDecl,
    QuantFormat,
    QuantizedWeight,
    declare,
    map_declared,
    stack_experts,
)

INT8_MAX = 127
ACTIVATION_MAX = {"int8": 127, "int16": 32767}  # activation_quantization: largest value


def check_quantization(name: str | None) -> str | None:
    """`name` if it is one jaxllm knows, else a ValueError listing them."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown {name!r}; choose one of "
                         f"{', '.join(str(q) for q in QUANTIZATIONS)}")
    return name


def quantize_int8(w: Float[Array, "K N"] | np.ndarray) -> QuantizedWeight:
    """`w` as int8 values and a per-column scale; numpy in, numpy out (weights held on
    the host for tensor parallelism), else jax arrays. A column of zeros gets scale 1."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = w.astype(np.float32)
    amax = xp.max(xp.abs(w), axis=0)
    scale = xp.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = xp.clip(xp.round(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return QuantizedWeight(q, scale)


def quantize_grouped(w: Float[Array, "K N"] | np.ndarray, fmt: QuantFormat, name: str = "weight") -> QuantizedWeight:
    """`w` as 4-bit values (8-bit: the int8_g* formats) with a float32 scale and min per
    `fmt.group` inputs of each column (asymmetric: the group's min and max map to 0 and
    15 (255), `q = round((w - min) / scale)`, `w ~ scale * q + min` within half a step;
    a constant group gets scale 1 and q = 0, exactly its value; 8-bit values are held
    as q - 128, their min as min + 128 * scale); numpy in, numpy out, else jax arrays. A
    matrix whose inputs the group does not divide is refused, naming it."""
    k, n = w.shape
    if k % fmt.group:
        other = " ('int4_g32' groups 32)" if fmt.name == "int4" else ""
        raise ValueError(f"quantization {fmt.name!r}: {name} has {k} inputs, not a multiple of {fmt.group} "
                         f"(its group){other}")
    xp = np if isinstance(w, np.ndarray) else jnp
    g = w.astype(np.float32).reshape(k // fmt.group, fmt.group, n)
    lo, hi = g.min(axis=1), g.max(axis=1)
    levels = (1 << fmt.bits) - 1
    scale = xp.where(hi > lo, (hi - lo) / levels, 1.0).astype(np.float32)
    q = xp.clip(xp.round((g - lo[:, None]) / scale[:, None]), 0, levels).reshape(k, n)
    offset = 0 if fmt.bits == 4 else 128  # int8 values: q - 128, the min shifted to match
    return QuantizedWeight((q - offset).astype(np.int8), scale, fmt.group, lo + offset * scale, bits=fmt.bits)


def quantize_blocks(w: Float[Array, "K N"] | np.ndarray, fmt: QuantFormat, name: str = "weight") -> QuantizedWeight:
    """`w` in one of GGUF's block formats (`fmt`: q8_0, q4_0, q4_1; 32 consecutive inputs
    of one output column share a float16 scale; gguf's own quantizer, bit-exact with
    llama.cpp's), kept as QuantizedWeight; numpy in, numpy out, else jax arrays."""
    import gguf

    k, n = w.shape
    if k % fmt.group:
        raise ValueError(f"quantization {fmt.name!r}: {name} has {k} inputs, not a multiple of {fmt.group} "
                         f"(its block)")
    on_host = isinstance(w, np.ndarray)
    kind = gguf.GGMLQuantizationType[fmt.name.upper()]
    blocks = gguf.quants.quantize(np.ascontiguousarray(np.asarray(w, np.float32).T), kind)
    qw = block_parts(blocks, fmt, n, k).transposed().map_arrays(np.ascontiguousarray)
    return qw if on_host else qw.map_arrays(jnp.asarray)


def quantize_weight(w: Float[Array, "K N"] | np.ndarray, name: str, tensor: str = "weight") -> QuantizedWeight:
    """`w` quantized as the QUANT_FORMATS entry `name` says: int8 per column, int4 with
    scales and mins per group, or GGUF blocks by gguf's own quantizer (`tensor` names it
    in errors)."""
    if name == "int8":
        return quantize_int8(w)
    fmt = QUANT_FORMATS[name]
    return (quantize_grouped if name in GROUPED_FORMATS else quantize_blocks)(w, fmt, tensor)


def dequantize(w: QuantizedWeight) -> Float[Array, "*E K N"] | Float[np.ndarray, "*E K N"]:
    """The float matrix `w` stands for (the oracle of the quantized matmul): each
    value times its scale, rounded once, plus its min where it has one, rounded again,
    as gguf's dequantization computes them (XLA:CPU does not contract the two into one
    multiply-add: tests/models/test_quant.py compares the jitted result with gguf's); then
    rounded to `w.float_dtype` (bfloat16 in a bfloat16 model)."""
    if not w.group:
        return w.q.astype(jnp.float32) * w.scale[..., None, :]  # [.., N] per column of [.., K, N]
    return _grouped_values(w).astype(w.float_dtype)


def _grouped_values(w: QuantizedWeight) -> Float[Array, "*E K N"] | Float[np.ndarray, "*E K N"]:
    # Each scale (min) gathered by its group's index along the grouped axis (the last
    # one for an embedding), not broadcast over a reshape: XLA:CPU saw through a
    # [K / 32, 32, N] reshape into a sum over the result (an RMS norm of embedding rows)
    # and split that sum by the groups, another order than the same sum over a
    # dequantized table.
    axis = w.group_axis + w.q.ndim - 2  # a mixture of experts' [E, K, N]: within each expert
    group_of = np.arange(w.q.shape[axis]) // w.group
    values = w.q.astype(jnp.float32) * jnp.take(w.scale, group_of, axis=axis)
    if w.mins is not None:
        values = values + jnp.take(w.mins, group_of, axis=axis)
    return values


X_BLOCK = 32  # inputs per activation scale under int8 (int16) activations


def activation_quantization_ready(w: QuantizedWeight) -> bool:
    """Whether `w` multiplies under int8 (int16) activations: a [K, N] matrix (a mixture's [E, K, N]
    experts) grouped along its inputs by a multiple of 32: Q4_0, Q4_1, int4, Q8_0 (not
    the gguf_int8 container: 16)."""
    return (len(w.shape) in (2, 3) and w.group_axis == 0 and w.group > 0 and w.group % X_BLOCK == 0
            and (w.bits == 4 or w.mins is None))


def quantize_activations(x: Float[Array, "M K"], dtype: str = "int8"
                         ) -> tuple[Int[Array, "M B 32"], Float[Array, "M B"], Int32[Array, "M B"]]:
    """x's rows as int8 (or int16: `dtype`) per block of 32 inputs: the values, the
    block's float32 scale (max |x| times float32(1/127) (1/32767), which is what XLA makes
    of a division by 127 and the kernel computes too; 0 for a block of zeros) and the sum
    of its values. Rounded to nearest, half to even (the kernel's nearbyint)."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // X_BLOCK, X_BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1) * (np.float32(1) / np.float32(ACTIVATION_MAX[dtype]))
    inv = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1), 0)
    q = jnp.round(blocks * inv[..., None]).astype(dtype)
    return q, scale, jnp.sum(q, axis=-1, dtype=jnp.int32)


def quantized_activation_matmul(x: Float[Array, "M K"], w: QuantizedWeight) -> Float[Array, "M N"]:
    """x @ w with x quantized to int8 or int16 (`w.activations`) per 32 inputs
    (quantize_activations): per block b of 32 inputs, the exact integer sum of x's values
    times w's (Q4_0's as signed), times w's scale and x's, plus (Q4_1, int4) w's min times
    the block's sum d_x * sum(q_x); float32 out. The `cpu` kernel's arithmetic
    (jaxllm/cpu_kernels/dense.cc, *_x8 and *_x16)."""
    if not activation_quantization_ready(w) or len(w.shape) != 2 or w.activations not in ACTIVATION_MAX:
        raise ValueError(f"int8/int16 activations: a [K, N] weight kept in blocks of a multiple of {X_BLOCK} inputs "
                         f"and marked so, not bits={w.bits} group={w.group} shape={w.shape} "
                         f"activations={w.activations!r}")
    q, d, s = quantize_activations(x, w.activations)
    k, n = w.shape
    isum = jnp.einsum("mbi,bin->mbn", q, w.q.reshape(k // X_BLOCK, X_BLOCK, n), preferred_element_type=jnp.int32)
    group_of = np.arange(k // X_BLOCK) * X_BLOCK // w.group
    y = isum.astype(jnp.float32) * (jnp.take(w.scale, group_of, axis=0) * d[..., None])
    if w.mins is not None:
        y = y + jnp.take(w.mins, group_of, axis=0) * (d * s.astype(jnp.float32))[..., None]
    return jnp.sum(y, axis=-2)


def grouped_quantized_activation_matmul(x: Float[Array, "M K"], w: QuantizedWeight,
                                        group_sizes: Int32[Array, " E"]) -> Float[Array, "M N"]:
    """A mixture of experts' quantized_activation_matmul: x's rows sorted by expert,
    `group_sizes[e]` of them times expert e's [K, N] (rows past the sum get zeros, as
    jax.lax.ragged_dot). Computes every expert for every row (the oracle, and the `xla`
    backend's path, as ragged_dot on a CPU)."""
    experts = w.shape[0]
    every = jnp.stack([quantized_activation_matmul(x, w.expert(e)) for e in range(experts)])  # [E, M, N]
    expert_of = jnp.sum(jnp.arange(x.shape[0])[:, None] >= jnp.cumsum(group_sizes)[None, :], axis=1)
    picked = jnp.take_along_axis(every, jnp.minimum(expert_of, experts - 1)[None, :, None], axis=0)[0]
    return jnp.where((expert_of < experts)[:, None], picked, 0.0)


def block_parts(blocks: np.ndarray, fmt: QuantFormat, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks of `fmt` (along a row: a float16 scale, for Q4_1 a
    float16 min, then 32 values: Q8_0 as int8, Q4_0 / Q4_1 as 16 bytes of nibbles, byte
    j holding value j low and value j + 16 high) as a QuantizedWeight grouped along its
    last axis: values [rows, cols], float16 scales (mins) [rows, cols / 32] as the file
    has them, in the file's (HF) orientation."""
    header = 4 if fmt.mins else 2  # float16 scale (and min) before the values
    blocks = np.asarray(blocks, np.uint8).reshape(-1, header + fmt.group * fmt.bits // 8)
    halves = lambda a: a.copy().view(np.float16).reshape(rows, cols // fmt.group)
    if fmt.bits == 8:
        q = blocks[:, header:].copy().view(np.int8)
    else:
        nibbles = blocks[:, header:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8)
        if not fmt.mins:
            q -= 8
    return QuantizedWeight(q.reshape(rows, cols), halves(blocks[:, :2]), fmt.group,
                           halves(blocks[:, 2:4]) if fmt.mins else None, fmt.bits, group_axis=1)


def _halves(a: np.ndarray) -> np.ndarray:
    """float16 fields of blocks (two bytes each) as float32 [blocks, fields]."""
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _fives(ql_qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 values: 16 bytes of nibbles (value j low, j + 16 high) and a 32-bit
    word of fifth bits, as uint8 [blocks, 32]."""
    low = np.concatenate([ql_qs & 0x0F, ql_qs >> 4], axis=1)
    high = (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return low | (high.astype(np.uint8) << 4)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per sub-block of 32, gguf's scale d * sc and min -(d_min * m)."""
    import gguf.quants

    d, dmin = _halves(blocks[:, 0:2]), _halves(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _decode_blocks(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values int8 [n, block], scale [n, block / g], min [n, block / g]) of n blocks of
    one GGUF type, g = 32 or 16 inputs per scale as the type has them."""
    n = blocks.shape[0]
    zero = np.zeros_like
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        parts = block_parts(blocks, QUANT_FORMATS[type_name.lower()], n, 32)
        scale = parts.scale.astype(np.float32)  # the container's scales are float32
        return parts.q, scale, parts.mins.astype(np.float32) if parts.mins is not None else zero(scale)
    if type_name == "Q5_0":
        d = _halves(blocks[:, 0:2])
        return (_fives(blocks[:, 6:22], blocks[:, 2:6]).astype(np.int8) - 16), d, zero(d)
    if type_name == "Q5_1":
        return _fives(blocks[:, 8:24], blocks[:, 4:8]).astype(np.int8), _halves(blocks[:, 0:2]), _halves(blocks[:, 2:4])
    if type_name in ("Q4_K", "Q5_K"):
        scale, mins = _k_scales(blocks)
        qs = blocks[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, 8, 32)
        if type_name == "Q5_K":
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & 1) << 4)
        return q.reshape(n, 256).astype(np.int8), scale, mins
    if type_name == "Q6_K":
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = ((ql & 0x0F).reshape(n, 2, 4, 32) | ((qh & 0x03) << 4)).astype(np.int8) - 32
        scale = _halves(blocks[:, 208:210]) * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return q.reshape(n, 256), scale, zero(scale)
    raise ValueError(f"GGUF type {type_name} is not kept in the gguf_int8 container; "
                     f"kept: {', '.join(GGUF_INT8_TYPES)}")


GGUF_INT8_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# A GGUF of mixed block types keeps each projection's weights as gguf dequantizes them:
# fl(fl(scale * q) + min), the scale gguf's own product (d * sub-block scale), the min its
# negated d_min * sub-block min (0 for types without one). In the `gguf_int8` container
# (int8 values, a float32 scale and min per 16 inputs: 12 bits a weight) any of
# GGUF_INT8_TYPES fits; a projection whose parts (q | k | v, gate | up, or one tensor; a
# mixture's every expert) are all of one set below is held in that tighter container:
# - Q4_0 alone: q4_0; Q4_1 alone: q4_1 (their own blocks, 4.5 / 5 bits);
# - Q4_K, with Q4_1 or not: int4_g32 (4-bit values, a float32 scale d * sc and min
#   -(d_min * m) per 32: fl(fl(scale * q) + min), as gguf dequantizes both; 6 bits);
# - Q8_0, Q5_0, Q4_0: q8_0 (int8 values q, q - 16, q - 8, their float16 d per 32:
#   fl(d * q) for all three; 8.5 bits).
MIXED_GGUF_FORMATS = (({"Q4_0"}, "q4_0"), ({"Q4_1"}, "q4_1"), ({"Q4_K", "Q4_1"}, "int4_g32"),
                      ({"Q8_0", "Q5_0", "Q4_0"}, "q8_0"))


def mixed_gguf_format(types: set[str]) -> str:
    """The format a projection of a mixed-type GGUF whose parts are of `types` is held in."""
    return next((fmt for allowed, fmt in MIXED_GGUF_FORMATS if types <= allowed), "gguf_int8")


def gguf_container_parts(blocks: np.ndarray, type_name: str, rows: int, cols: int,
                         fmt: str = "gguf_int8") -> QuantizedWeight:
    """A GGUF tensor of one of GGUF_INT8_TYPES in the container `fmt` (the `gguf_int8`
    one, or one `mixed_gguf_format` gives its type), grouped along its last axis in the
    file's (HF) orientation: int8 values [rows, cols], scales (and mins) [rows, cols /
    group] in the format's dtype (a type with 32 inputs per scale repeats each for 16)."""
    import gguf

    form = QUANT_FORMATS[fmt]
    if fmt != "gguf_int8" and type_name not in {t for allowed, f in MIXED_GGUF_FORMATS if f == fmt for t in allowed}:
        raise ValueError(f"GGUF type {type_name} is not held exactly as {fmt}")
    kind = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    q, scale, mins = _decode_blocks(np.asarray(blocks, np.uint8).reshape(-1, size), type_name)
    per = block // scale.shape[1] // form.group  # 2 where a scale covers 32 inputs and the container 16

    def spread(a):
        return np.repeat(a, per, axis=1).reshape(rows, cols // form.group).astype(form.scale_dtype)

    return QuantizedWeight(np.ascontiguousarray(q.reshape(rows, cols)), spread(scale), form.group,
                           spread(mins) if form.mins else None, form.bits, group_axis=1)


def quantized_config(cfg: ModelConfig, quantization: str | None) -> ModelConfig:
    """`cfg` with the weight quantization the engine will hold (a QUANT_FORMATS name);
    None and "none" both leave the projections as loaded (the config says None)."""
    check_quantization(quantization)
    return dataclasses.replace(cfg, quantization=None if quantization == "none" else quantization)


def quantize_params(cfg: ModelConfig, params: ModelParams) -> ModelParams:
    """Loaded float params with every projection `cfg`'s declaration marks quantized
    (`quantized_config`) replaced by its QuantizedWeight; the rest as they are."""

    def convert(decl: ParamDecl, array):
        if decl.quant is None or isinstance(array, QuantizedWeight):
            return array
        if decl.quant == "gguf_int8":
            raise ValueError("quantization 'gguf_int8' is how a GGUF of mixed block types keeps its blocks; "
                             "float weights cannot be quantized to it: use int8, q8_0, q4_0 or q4_1")
        w = array if isinstance(array, np.ndarray) else jnp.asarray(array)
        if decl.experts:  # each expert's [K, N] quantized as a projection of its own, then stacked
            return stack_experts([convert(one, w[e]) for e, one in enumerate(decl.per_expert())])
        return quantize_weight(w, decl.quant, decl.hf[0][0])

    return map_declared(convert, declare(cfg), params)


def param_bytes(params: ModelParams) -> int:
    """Bytes the parameters take (quantized ones with their scales and mins)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
