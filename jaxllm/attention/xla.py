"""The XLA (pure jnp) attention backend over the paged KV cache.

Each token gathers the K/V of its own sequence through the block table and does a
masked softmax over it: causal within the sequence, optionally a sliding window. It
runs on every platform and is the CPU path.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm.attention.metadata import AttentionMetadata

# Finite, so fully masked padding rows give finite garbage instead of NaN (a NaN would
# reach the null block through the cache write and poison 0 * NaN products).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def token_positions(md: AttentionMetadata, num_tokens: int) -> tuple[Int[Array, "T"], Int[Array, "T"]]:
    """(sequence index, absolute position) of each token of the flat batch."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = md.block_tables.shape[0]
    seq = jnp.searchsorted(md.query_start_loc[1:], token, side="right")
    seq = jnp.minimum(seq, num_seqs - 1).astype(jnp.int32)
    q_len = md.query_start_loc[seq + 1] - md.query_start_loc[seq]
    position = md.seq_lens[seq] - q_len + (token - md.query_start_loc[seq])
    return seq, position


def paged_attention(
    q: Float[Array, "T H hd"],
    k_cache: Float[Array, "N B Hkv hd"],
    v_cache: Float[Array, "N B Hkv hd"],
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
) -> Float[Array, "T H hd"]:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = md.block_tables.shape[1]
    group = num_heads // num_kv_heads

    seq, q_pos = token_positions(md, num_tokens)
    blocks = md.block_tables[seq]  # [T, B]
    k = k_cache[blocks].reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache[blocks].reshape(num_tokens, max_blocks * block_size, num_kv_heads, head_dim)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    k_pos = jnp.arange(max_blocks * block_size, dtype=jnp.int32)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    probs = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
