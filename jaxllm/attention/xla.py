"""The XLA (pure jnp) attention backend over the paged KV cache: the CPU path.

Cost follows the real sequence lengths, not max_model_len: K/V are read through the
block tables in chunks of KV_CHUNK tokens inside loops whose trip counts are dynamic,
with an online softmax across chunks. The ragged batch is split into two kinds of
work, planned inside the jitted step from query_start_loc:

- decodes (sequences with one new token): one vectorized pass over all of them, each
  row reading its own sequence's chunks (the loop runs to the longest decode);
- prefill chunks (sequences with several new tokens): query tiles of QUERY_TILE rows
  that belong to one sequence, processed one after another, each reading its chunks
  up to its last query's position (causal) and from its sliding window's start.

Same signature as pallas_kernels.ragged_paged_attention, so the backends swap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

QUERY_TILE = 32  # query rows per prefill tile
KV_CHUNK = 128  # key/value tokens read per loop iteration (a multiple of block_size)
MASK_VALUE = -1e30  # finite: a fully masked row gives finite garbage, never NaN


def _chunk_blocks(block_size: int) -> int:
    return max(1, KV_CHUNK // block_size)


def _pad_block_tables(block_tables: Int[Array, "S B"], blocks_per_chunk: int) -> Int[Array, "S B2"]:
    """Pad the width to a multiple of a chunk so a chunk's dynamic slice never clamps."""
    pad = (-block_tables.shape[1]) % blocks_per_chunk
    return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def _online_softmax_step(carry, scores, v_chunk, spec: str):
    """Fold one chunk of masked scores [..., C] and values into (max, sum, acc)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, scores.max(axis=-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    l = l * scale + p.sum(axis=-1)
    acc = acc * scale[..., None] + jnp.einsum(spec, p, v_chunk, preferred_element_type=jnp.float32)
    return m_new, l, acc


def _mask(k_pos, q_pos, sliding_window: int | None):
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def _softcap(scores, soft_cap: float | None):
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _decode_attention(q, k_cache, v_cache, seq_lens, tables, active, *, sm_scale, sliding_window, soft_cap):
    """One query per row: q [R, Hkv, G, D]; row r reads table row tables[r] up to
    seq_lens[r]; inactive rows read nothing useful and are discarded by the caller."""
    rows, hkv, group, hd = q.shape
    _, bs, _, _ = k_cache.shape
    nb = _chunk_blocks(bs)
    chunk = nb * bs
    q_pos = seq_lens - 1
    lens = jnp.where(active, seq_lens, 0)
    num_chunks = (lens.max() + chunk - 1) // chunk
    first = 0
    if sliding_window is not None:
        first = jnp.where(active, jnp.maximum(q_pos - sliding_window + 1, 0), jnp.iinfo(jnp.int32).max).min()
        first = jnp.minimum(first, num_chunks * chunk) // chunk

    def body(j, carry):
        ids = jax.lax.dynamic_slice_in_dim(tables, j * nb, nb, axis=1)  # [R, nb]
        k = k_cache[ids].reshape(rows, chunk, hkv, hd)
        v = v_cache[ids].reshape(rows, chunk, hkv, hd)
        s = jnp.einsum("rkgd,rckd->rkgc", q, k, preferred_element_type=jnp.float32) * sm_scale
        s = _softcap(s, soft_cap)
        k_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = _mask(k_pos[None, :], q_pos[:, None], sliding_window)  # [R, C]
        s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
        return _online_softmax_step(carry, s, v.astype(jnp.float32), "rkgc,rckd->rkgd")

    init = (
        jnp.full((rows, hkv, group), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, hkv, group), jnp.float32),
        jnp.zeros((rows, hkv, group, hd), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first, num_chunks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _tile_attention(q_tile, q_pos0, num_rows, k_cache, v_cache, table, *, sm_scale, sliding_window, soft_cap):
    """QUERY_TILE consecutive queries of one sequence, at positions q_pos0 + i."""
    hkv, group, tile, hd = q_tile.shape
    _, bs, _, _ = k_cache.shape
    nb = _chunk_blocks(bs)
    chunk = nb * bs
    q_pos = q_pos0 + jnp.arange(tile, dtype=jnp.int32)
    kv_end = q_pos0 + num_rows  # exclusive: the last valid query's position + 1
    num_chunks = (kv_end + chunk - 1) // chunk
    first = 0 if sliding_window is None else jnp.maximum(q_pos0 - sliding_window + 1, 0) // chunk

    def body(j, carry):
        ids = jax.lax.dynamic_slice_in_dim(table, j * nb, nb)
        k = k_cache[ids].reshape(chunk, hkv, hd)
        v = v_cache[ids].reshape(chunk, hkv, hd)
        s = jnp.einsum("kgtd,ckd->kgtc", q_tile, k, preferred_element_type=jnp.float32) * sm_scale
        s = _softcap(s, soft_cap)
        k_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = _mask(k_pos[None, :], q_pos[:, None], sliding_window)  # [tile, C]
        s = jnp.where(visible[None, None], s, MASK_VALUE)
        return _online_softmax_step(carry, s, v.astype(jnp.float32), "kgtc,ckd->kgtd")

    init = (
        jnp.full((hkv, group, tile), MASK_VALUE, jnp.float32),
        jnp.zeros((hkv, group, tile), jnp.float32),
        jnp.zeros((hkv, group, tile, hd), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first, num_chunks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def ragged_paged_attention_xla(
    q: Float[Array, "T H hd"],
    k_cache: Float[Array, "N B Hkv hd"],
    v_cache: Float[Array, "N B Hkv hd"],
    kv_lens: Int[Array, "S"],
    block_tables: Int[Array, "S MB"],
    query_start_loc: Int[Array, "S1"],
    num_seqs: Int[Array, ""],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "T H hd"]:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_slots = block_tables.shape[0]
    group = num_heads // num_kv_heads
    tables = _pad_block_tables(block_tables, _chunk_blocks(block_size))
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]
    real = jnp.arange(num_slots) < jnp.reshape(num_seqs, (-1,))[0]
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    out = jnp.zeros((num_tokens + QUERY_TILE, num_kv_heads, group, head_dim), jnp.float32)

    # Decodes: every sequence with exactly one new token, vectorized.
    is_decode = real & (q_lens == 1)
    decode_q = q[jnp.minimum(qsl[:-1], num_tokens - 1)].reshape(num_slots, num_kv_heads, group, head_dim)
    decode_out = _decode_attention(decode_q, k_cache, v_cache, kv_lens, tables, is_decode, **kw)
    decode_rows = jnp.where(is_decode, qsl[:-1], num_tokens + QUERY_TILE)  # out of range: dropped
    out = out.at[decode_rows].set(decode_out, mode="drop")

    # Prefill chunks: tiles of QUERY_TILE rows, each inside one sequence.
    is_prefill = real & (q_lens > 1)
    tiles_per_seq = jnp.where(is_prefill, (q_lens + QUERY_TILE - 1) // QUERY_TILE, 0)
    tile_ends = jnp.cumsum(tiles_per_seq)
    q_padded = jnp.pad(q, ((0, QUERY_TILE), (0, 0), (0, 0)))

    def tile_body(i, out):
        s = jnp.searchsorted(tile_ends, i, side="right")
        k = i - (tile_ends[s] - tiles_per_seq[s])
        start = qsl[s] + k * QUERY_TILE
        num_rows = jnp.minimum(QUERY_TILE, q_lens[s] - k * QUERY_TILE)
        q_pos0 = kv_lens[s] - q_lens[s] + k * QUERY_TILE
        q_tile = jax.lax.dynamic_slice_in_dim(q_padded, start, QUERY_TILE)
        q_tile = q_tile.reshape(QUERY_TILE, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
        o = _tile_attention(q_tile, q_pos0, num_rows, k_cache, v_cache, tables[s], **kw)
        o = o.transpose(2, 0, 1, 3)  # [tile, Hkv, G, D]
        old = jax.lax.dynamic_slice_in_dim(out, start, QUERY_TILE)
        keep_new = (jnp.arange(QUERY_TILE) < num_rows)[:, None, None, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep_new, o, old), start, axis=0)

    out = jax.lax.fori_loop(0, tile_ends[-1], tile_body, out)
    return out[:num_tokens].reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
