"""Weight-only quantization of the projections, as their declaration says
(jaxllm.models.params: `ParamDecl.quant`, set from `ModelConfig.quantization`).

`int8`: symmetric, a float32 scale per output column, `scale = max|w[:, n]| / 127`,
`q = round(w / scale)` (half to even), so that `w ~ q * scale` within half a step of
the scale. A projection then reads 1 byte a weight instead of 4 (float32) or 2
(bfloat16); `linear` multiplies `x @ q` and scales the columns after the dot, which is
exact reassociation (the scale is per column), so the XLA path is `x @ dequantize(w)`
up to the dot's own rounding.

`q8_0`: GGUF's Q8_0, a float16 scale per 32 inputs of each column (gguf's quantizer),
held as int8 values and float32 scales [K / 32, N]; a GGUF whose projections are Q8_0
keeps its blocks (jaxllm.loaders.gguf_loader). Each weight is `q * scale` rounded once,
as gguf dequantizes it, so the kernel's sums are those of the dequantized matrix.

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
from jaxllm.models.params import Q8_0_GROUP, ModelParams, ParamDecl, QuantizedWeight, declare, map_declared

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


def quantize_q8_0(w: Float[Array, "K N"] | np.ndarray, name: str = "weight") -> QuantizedWeight:
    """`w` as GGUF Q8_0 blocks (32 consecutive inputs of one output column share a
    float16 scale; gguf's own quantizer, bit-exact with llama.cpp's), kept as int8
    values and float32 scales [K / 32, N]; numpy in, numpy out, else jax arrays."""
    import gguf

    k, n = w.shape
    if k % Q8_0_GROUP:
        raise ValueError(f"quantization 'q8_0': {name} has {k} inputs, not a multiple of {Q8_0_GROUP} (its block)")
    on_host = isinstance(w, np.ndarray)
    blocks = gguf.quants.quantize(np.ascontiguousarray(np.asarray(w, np.float32).T), gguf.GGMLQuantizationType.Q8_0)
    q, scale = q8_0_parts(blocks, n, k)
    q, scale = np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T)
    return QuantizedWeight(q, scale, Q8_0_GROUP) if on_host else QuantizedWeight(jnp.asarray(q), jnp.asarray(scale),
                                                                                  Q8_0_GROUP)


def dequantize(w: QuantizedWeight) -> Float[Array, "K N"]:
    """The float32 matrix `w` stands for (the oracle of the quantized matmul): each
    value times its scale, rounded once, as gguf's Q8_0 dequantization computes it."""
    if not w.group:
        return w.q.astype(jnp.float32) * w.scale
    k, n = w.q.shape
    return (w.q.reshape(k // w.group, w.group, n).astype(jnp.float32) * w.scale[:, None, :]).reshape(k, n)


def q8_0_parts(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 values [rows, cols] and float32 scales [rows, cols / 32] of a GGUF Q8_0
    tensor's raw blocks (2 bytes of float16 scale, then 32 int8 values, along a row)."""
    blocks = np.asarray(blocks, np.uint8).reshape(-1, 2 + Q8_0_GROUP)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // Q8_0_GROUP)
    q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return q, scale


def quantized_config(cfg: ModelConfig, quantization: str | None) -> ModelConfig:
    """`cfg` with the weight quantization the engine will hold: "int8" or "q8_0"; None
    and "none" both leave the projections as loaded (the config says None)."""
    check_quantization(quantization)
    return dataclasses.replace(cfg, quantization=None if quantization == "none" else quantization)


def quantize_params(cfg: ModelConfig, params: ModelParams) -> ModelParams:
    """Loaded float params with every projection `cfg`'s declaration marks quantized
    (`quantized_config`) replaced by its QuantizedWeight; the rest as they are."""

    def convert(decl: ParamDecl, array):
        if decl.quant is None or isinstance(array, QuantizedWeight):
            return array
        if decl.quant == "int8":
            return quantize_int8(array if isinstance(array, np.ndarray) else jnp.asarray(array))
        if decl.quant == "q8_0":
            return quantize_q8_0(array if isinstance(array, np.ndarray) else jnp.asarray(array), decl.hf[0][0])
        raise ValueError(f"quantization {decl.quant!r} is declared but not implemented")

    return map_declared(convert, declare(cfg), params)


def param_bytes(params: ModelParams) -> int:
    """Bytes the parameters take (quantized ones with their scales)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
