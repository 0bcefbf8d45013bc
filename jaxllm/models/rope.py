"""Rotary position embeddings (the HF "rotate_half" convention), with Llama-3 and
linear frequency scaling."""

from __future__ import annotations

import math
import typing

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float

from jaxllm.config import ModelConfig, RopeConfig


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


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class RopeTable:
    """cos and sin of position x inverse frequency, [positions, head_dim // 2] float32,
    for every position below the model length: computed once, gathered per step by
    position. (Computed inside the step, XLA:CPU fused cos and sin into every layer's
    RoPE and evaluated them per head and layer: ~40 ms of a 512-token SmolLM2 step.)"""

    cos: Float[Array, "P half"]
    sin: Float[Array, "P half"]
    # Gemma 3: the sliding layers' own table (ModelConfig.rope_local); None: one table
    local_cos: Float[Array, "P half"] | None = None
    local_sin: Float[Array, "P half"] | None = None


def rope_table(rope: RopeConfig, head_dim: int, max_positions: int) -> RopeTable:
    """The table for positions [0, max_positions), in float32 as HF computes it (the
    product position x inv_freq rounded to float32 before cos and sin)."""
    freqs = np.arange(max_positions, dtype=np.float32)[:, None] * inverse_frequencies(rope, head_dim)[None, :]
    return RopeTable(jnp.asarray(np.cos(freqs)), jnp.asarray(np.sin(freqs)))


def model_rope_table(cfg: ModelConfig, max_positions: int) -> RopeTable:
    """The table(s) of `cfg`'s RoPE: with a local RoPE for sliding layers (Gemma 3),
    both."""
    table = rope_table(cfg.rope, cfg.head_dim, max_positions)
    if cfg.rope_local is None:
        return table
    local = rope_table(cfg.rope_local, cfg.head_dim, max_positions)
    return table.replace(local_cos=local.cos, local_sin=local.sin)


def apply_rope(
    x: Float[Array, "T N hd"], cos: Float[Array, "T half"], sin: Float[Array, "T half"]
) -> Float[Array, "T N hd"]:
    """Rotate the two halves of each head (HF's rotate_half convention). Written as two
    half-width products and one concatenate: negating and concatenating the halves of
    the input first made XLA:CPU's fusion ~10x slower."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
