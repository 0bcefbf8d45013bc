"""Weight-only quantization of the projections, as their declaration says
(jaxllm.models.params: `ParamDecl.quant`, set from `ModelConfig.quantization`).

`int8`: symmetric, a float32 scale per output column, `scale = max|w[:, n]| / 127`,
`q = round(w / scale)` (half to even), so that `w ~ q * scale` within half a step of
the scale. A projection then reads 1 byte a weight instead of 4 (float32) or 2
(bfloat16); `linear` multiplies `x @ q` and scales the columns after the dot, which is
exact reassociation (the scale is per column), so the XLA path is `x @ dequantize(w)`
up to the dot's own rounding.

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
from jaxllm.models.params import ModelParams, ParamDecl, QuantizedWeight, declare, map_declared

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


def dequantize(w: QuantizedWeight) -> Float[Array, "K N"]:
    """The float32 matrix `w` stands for (the oracle of the quantized matmul)."""
    return w.q.astype(jnp.float32) * w.scale


def quantized_config(cfg: ModelConfig, quantization: str | None) -> ModelConfig:
    """`cfg` with the weight quantization the engine will hold (None and "none" leave
    the projections as loaded)."""
    check_quantization(quantization)
    return dataclasses.replace(cfg, quantization=quantization)


def quantize_params(cfg: ModelConfig, params: ModelParams) -> ModelParams:
    """Loaded float params with every projection `cfg`'s declaration marks quantized
    (`quantized_config`) replaced by its QuantizedWeight; the rest as they are."""

    def convert(decl: ParamDecl, array):
        if decl.quant is None or isinstance(array, QuantizedWeight):
            return array
        if decl.quant == "int8":
            return quantize_int8(array if isinstance(array, np.ndarray) else jnp.asarray(array))
        raise ValueError(f"quantization {decl.quant!r} is declared but not implemented")

    return map_declared(convert, declare(cfg), params)


def param_bytes(params: ModelParams) -> int:
    """Bytes the parameters take (quantized ones with their scales)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
