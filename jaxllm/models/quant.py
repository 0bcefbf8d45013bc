"""Weight-only quantization of the projections, as their declaration says
(jaxllm.models.params: `ParamDecl.quant`, set from `ModelConfig.quantization`).

`int8`: symmetric, a float32 scale per output column, `scale = max|w[:, n]| / 127`,
`q = round(w / scale)` (half to even), so that `w ~ q * scale` within half a step of
the scale. A projection then reads 1 byte a weight instead of 4 (float32) or 2
(bfloat16); `linear` multiplies `x @ q` and scales the columns after the dot, which is
exact reassociation (the scale is per column), so the XLA path is `x @ dequantize(w)`
up to the dot's own rounding.

`q8_0`, `q4_0`, `q4_1`: GGUF's block formats, a float16 scale per 32 inputs of each
column (gguf's own quantizer), held as int8 values and float32 scales [K / 32, N]: Q8_0
values in [-127, 127], Q4_0 in [-8, 7] (the stored nibble minus 8), Q4_1 in [0, 15]
with a float16 min per block as well (w = d * q + m). A GGUF whose projections are all
of one of these keeps its blocks (jaxllm.loaders.gguf_loader). Each weight is what
gguf dequantizes it to, `q * scale` rounded once (then `+ min`, rounded again: never a
fused multiply-add), so the kernel's sums are those of the dequantized matrix.

The embedding (a lookup) and the norms stay as loaded, as in vLLM's weight-only
schemes; so does a tied output projection, which is the embedding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxllm.config import QUANTIZATIONS, ModelConfig
from jaxllm.models.params import (QUANT_FORMATS, ModelParams, ParamDecl, QuantFormat, QuantizedWeight,
                                  declare, map_declared)

INT8_MAX = 127


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


def dequantize(w: QuantizedWeight) -> Float[Array, "K N"]:
    """The float32 matrix `w` stands for (the oracle of the quantized matmul): each
    value times its scale, rounded once, plus its min where it has one, rounded again,
    as gguf's dequantization computes them (XLA:CPU does not contract the two into one
    multiply-add: tests/test_quant.py compares the jitted result with gguf's)."""
    if not w.group:
        return w.q.astype(jnp.float32) * w.scale
    # Each scale (min) gathered by its group's index along the grouped axis (the last
    # one for an embedding), not broadcast over a reshape: XLA:CPU saw through a
    # [K / 32, 32, N] reshape into a sum over the result (an RMS norm of embedding rows)
    # and split that sum by the groups, another order than the same sum over a
    # dequantized table.
    axis = w.group_axis
    group_of = np.arange(w.q.shape[axis]) // w.group
    values = w.q.astype(jnp.float32) * jnp.take(w.scale, group_of, axis=axis)
    if w.mins is not None:
        values = values + jnp.take(w.mins, group_of, axis=axis)
    return values


def block_parts(blocks: np.ndarray, fmt: QuantFormat, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks of `fmt` (along a row: a float16 scale, for Q4_1 a
    float16 min, then 32 values: Q8_0 as int8, Q4_0 / Q4_1 as 16 bytes of nibbles, byte
    j holding value j low and value j + 16 high) as a QuantizedWeight grouped along its
    last axis: values [rows, cols], scales (mins) [rows, cols / 32], in the file's (HF)
    orientation."""
    header = 4 if fmt.mins else 2  # float16 scale (and min) before the values
    blocks = np.asarray(blocks, np.uint8).reshape(-1, header + fmt.group * fmt.bits // 8)
    halves = lambda a: a.copy().view(np.float16).astype(np.float32).reshape(rows, cols // fmt.group)  # noqa: E731
    if fmt.bits == 8:
        q = blocks[:, header:].copy().view(np.int8)
    else:
        nibbles = blocks[:, header:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int8)
        if not fmt.mins:
            q -= 8
    return QuantizedWeight(q.reshape(rows, cols), halves(blocks[:, :2]), fmt.group,
                           halves(blocks[:, 2:4]) if fmt.mins else None, fmt.bits, group_axis=1)


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
        w = array if isinstance(array, np.ndarray) else jnp.asarray(array)
        return quantize_int8(w) if decl.quant == "int8" else quantize_blocks(w, QUANT_FORMATS[decl.quant],
                                                                             decl.hf[0][0])

    return map_declared(convert, declare(cfg), params)


def param_bytes(params: ModelParams) -> int:
    """Bytes the parameters take (quantized ones with their scales and mins)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
