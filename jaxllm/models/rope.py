"""Rotary position embeddings (the HF "rotate_half" convention), with Llama-3 and
linear frequency scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 [head_dim // 2] inverse frequencies, scaled as `rope.type` says."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (rope.theta**exponents)).astype(np.float32)
    if rope.type == "linear":
        inv_freq = (inv_freq / rope.factor).astype(np.float32)
    elif rope.type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    if rope.freq_factors is not None:
        inv_freq = (inv_freq / np.asarray(rope.freq_factors, np.float32)).astype(np.float32)
    return inv_freq


def _llama3_scaled(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a
    smooth interpolation between."""
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(
    positions: Int[Array, "T"], inv_freq: Float[Array, "half"]
) -> tuple[Float[Array, "T hd"], Float[Array, "T hd"]]:
    """cos and sin tables for the given positions, float32, duplicated to head_dim."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(
    x: Float[Array, "T N hd"], cos: Float[Array, "T hd"], sin: Float[Array, "T hd"]
) -> Float[Array, "T N hd"]:
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)
