"""The XLA (pure jnp) attention backend over the paged KV cache: the CPU path.

Cost follows the real sequence lengths, not max_model_len: K/V are read through the
block tables in chunks inside loops whose trip counts are dynamic, with an online
softmax across chunks. The ragged batch is split into two kinds of work, planned
inside the jitted step from query_start_loc:

- decodes (sequences with one new token): the rows are sorted by length, longest
  first, and the loop runs over (kv chunk j, group of DECODE_ROWS rows that still
  need chunk j): the rows that need chunk j are a prefix of the sorted order, so every
  row reads its own length (rounded up to a chunk), not the longest row's;
- prefill chunks (sequences with several new tokens): query tiles of QUERY_TILE rows
  that belong to one sequence, processed one after another, each reading its chunks
  of KV_CHUNK keys up to its last query's position (causal) and from its sliding
  window's start.

K/V chunks are gathered as whole cache blocks (rows of a [num_blocks, block_size *
Hkv * hd] view), which XLA:CPU copies at memory speed. Decode rows with few KV heads
(GQA groups of SmolLM2-like models) lay their query heads out block-diagonally over
the KV heads, so both dots of a chunk are batched matmuls against the gathered
[chunk, Hkv * hd] with no transposed copy of K or V (the off-diagonal blocks cost
Hkv-times the FLOPs, cheap next to the memory traffic: decode attention is bound by
reading the cache). Prefill tiles are compute-bound and use one batched matmul per KV
head instead.

Same signature as pallas_kernels.ragged_paged_attention, so the backends swap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from jaxllm.attention.kv_cache import as_elements, dequantize_rows

QUERY_TILE = 128  # query rows per prefill tile
KV_CHUNK = 256  # key/value tokens a prefill tile reads per loop iteration
DECODE_ROWS = 8  # decode rows per loop iteration (8: ~10% faster than 16 at 64 rows of ~400 tokens)
DECODE_CHUNK = 128  # key/value tokens a decode row reads per loop iteration
BLOCK_DIAGONAL_MAX_KV_HEADS = 4  # block-diagonal decode queries up to this many KV heads
MASK_VALUE = -1e30  # finite: a fully masked row gives finite garbage, never NaN


def _chunk_blocks(block_size: int, chunk_tokens: int) -> int:
    return max(1, chunk_tokens // block_size)


def _pad_block_tables(block_tables: Int[Array, "S MB"], blocks_per_chunk: int) -> Int[Array, "S MB2"]:
    """Pad the width to a multiple of a chunk so a chunk's dynamic slice never clamps."""
    pad = (-block_tables.shape[1]) % blocks_per_chunk
    return jnp.pad(block_tables, ((0, 0), (0, pad))) if pad else block_tables


def _gather_blocks(cache: Shaped[Array, "N B Hkv hd"], ids: Int[Array, "... nb"],
                   scale: Float[Array, "N B Hkv"] | None = None, cache_dtype: str = "") -> Float[Array, "... C X"]:
    """The blocks `ids` of a cache (holding `cache_dtype`'s bits where named) as
    float32 [..., nb * block_size, Hkv * hd] (a row gather; an int8 cache's rows times
    their scales)."""
    n, bs, hkv, hd = cache.shape
    shape = (*ids.shape[:-1], ids.shape[-1] * bs, hkv, hd)
    rows = cache.reshape(n, bs * hkv * hd).at[ids].get(mode="promise_in_bounds").reshape(shape)
    rows = as_elements(rows, cache_dtype)
    if scale is not None:
        scale = scale.reshape(n, bs * hkv).at[ids].get(mode="promise_in_bounds").reshape(shape[:-1])
    return dequantize_rows(rows, scale).reshape(*shape[:-2], hkv * hd)


def _mask(k_pos, q_pos, sliding_window: int | None):
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    return visible


def apply_soft_cap(scores, soft_cap: float | None):
    """`soft_cap * tanh(scores / soft_cap)` (Gemma 2's attention and logit capping);
    None: `scores` as they are."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _block_diagonal(q: Float[Array, "... Hkv G hd"]) -> Float[Array, "... M X"]:
    """[..., Hkv, G, hd] -> [..., Hkv*G, Hkv*hd], zero outside each head's own KV head."""
    hkv, group, hd = q.shape[-3:]
    eye = jnp.eye(hkv, dtype=q.dtype)
    bd = q[..., :, :, None, :] * eye[:, None, :, None]  # [..., Hkv, G, Hkv, hd]
    return bd.reshape(*q.shape[:-3], hkv * group, hkv * hd)


def _take_diagonal(o: Float[Array, "... M X"], hkv: int, group: int, hd: int) -> Float[Array, "... M hd"]:
    """Inverse of the block-diagonal layout on the output: [..., Hkv*G, Hkv*hd] ->
    [..., Hkv*G, hd], each head's values from its own KV head."""
    o = o.reshape(*o.shape[:-2], hkv, group, hkv, hd)
    return jnp.stack([o[..., i, :, i, :] for i in range(hkv)], axis=-3).reshape(*o.shape[:-4], hkv * group, hd)


def _scores(q, k, hkv: int, hd: int, block_diagonal: bool):
    """q: [..., M, X] (block-diagonal) or [..., Hkv, G, hd]; k: [..., C, Hkv*hd] -> [..., M, C]."""
    if block_diagonal:
        return jnp.einsum("...mx,...cx->...mc", q, k, preferred_element_type=jnp.float32)
    k = k.reshape(*k.shape[:-1], hkv, hd)
    s = jnp.einsum("...kgd,...ckd->...kgc", q, k, preferred_element_type=jnp.float32)
    return s.reshape(*s.shape[:-3], -1, s.shape[-1])


def _values(p, v, hkv: int, group: int, hd: int, block_diagonal: bool):
    """p: [..., M, C]; v: [..., C, Hkv*hd] -> [..., M, hd]."""
    if block_diagonal:
        return _take_diagonal(jnp.einsum("...mc,...cx->...mx", p, v, preferred_element_type=jnp.float32), hkv, group, hd)
    p = p.reshape(*p.shape[:-2], hkv, group, p.shape[-1])
    v = v.reshape(*v.shape[:-1], hkv, hd)
    o = jnp.einsum("...kgc,...ckd->...kgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(*o.shape[:-3], hkv * group, hd)


def _online_softmax_step(m, l, acc, scores, values_fn):
    """Fold one chunk of masked scores [..., M, C] into (max, sum, acc)."""
    m_new = jnp.maximum(m, scores.max(axis=-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    l = l * scale + p.sum(axis=-1)
    acc = acc * scale[..., None] + values_fn(p)
    return m_new, l, acc


def _index_of_iteration(ends: Int[Array, " J"], num_iterations: int) -> Int[Array, " I"]:
    """For iterations 0..num_iterations-1 of a loop whose iterations are grouped
    (group j ends before iteration ends[j]): the group of each iteration. A vectorized
    searchsorted, computed once per step: inside a loop body jnp.searchsorted is a
    nested while loop, per iteration and per layer."""
    it = jnp.arange(num_iterations, dtype=jnp.int32)
    return jnp.minimum((ends[None, :] <= it[:, None]).sum(axis=1), ends.shape[0] - 1).astype(jnp.int32)


def _decode_plan(seq_lens, tables, active, block_size: int):
    """What the decode loop needs, from the step's metadata only (so XLA computes it
    once for all layers): rows sorted longest first, and per loop iteration the KV
    chunk j and the first sorted row r0 of its group of g rows."""
    rows = seq_lens.shape[0]
    nb = _chunk_blocks(block_size, DECODE_CHUNK)
    chunk = nb * block_size
    g = min(DECODE_ROWS, rows)
    lens = jnp.where(active, seq_lens, 0)
    order = jnp.argsort(-lens, stable=True)
    lens_s = jnp.pad(lens[order], (0, g))  # g padding rows: a group's slice never clamps
    max_chunks = tables.shape[1] // nb
    num_chunks = (lens_s + chunk - 1) // chunk
    need = (num_chunks[None, :] > jnp.arange(max_chunks)[:, None]).sum(axis=1)  # rows needing chunk j
    groups = (need + g - 1) // g
    ends = jnp.cumsum(groups)
    j = _index_of_iteration(ends, max_chunks * (-(-rows // g)))
    r0 = (jnp.arange(j.shape[0], dtype=jnp.int32) - (ends[j] - groups[j])) * g
    return dict(
        order=order,
        inverse=jnp.zeros(rows, jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32)),
        q_pos=lens_s - 1,
        tables=jnp.pad(tables[order], ((0, g), (0, 0))),
        chunk_of_iteration=j,
        row_of_iteration=r0,
        num_iterations=ends[-1],
    )


def _decode_attention(q, k_cache, v_cache, k_scale, v_scale, plan, *, sm_scale, sliding_window, soft_cap,
                      cache_dtype):
    """One query per row: q [R, Hkv, G, D]; row r reads its table row up to its
    length; inactive rows read nothing useful and are discarded by the caller."""
    rows, hkv, group, hd = q.shape
    _, bs, _, _ = k_cache.shape
    nb = _chunk_blocks(bs, DECODE_CHUNK)
    chunk = nb * bs
    g = min(DECODE_ROWS, rows)
    bd = hkv <= BLOCK_DIAGONAL_MAX_KV_HEADS
    m_rows = hkv * group
    q_s = jnp.pad(q[plan["order"]].astype(jnp.float32), ((0, g), (0, 0), (0, 0), (0, 0)))
    q_s = (_block_diagonal(q_s) if bd else q_s) * sm_scale

    def body(it, carry):
        m, l, acc = carry
        j, r0 = plan["chunk_of_iteration"][it], plan["row_of_iteration"][it]
        ids = jax.lax.dynamic_slice(plan["tables"], (r0, j * nb), (g, nb))
        k = _gather_blocks(k_cache, ids, k_scale, cache_dtype)  # [g, C, Hkv*hd]
        v = _gather_blocks(v_cache, ids, v_scale, cache_dtype)
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, r0, g)
        s = apply_soft_cap(_scores(sl(q_s), k, hkv, hd, bd), soft_cap)  # [g, M, C]
        k_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = _mask(k_pos[None, :], sl(plan["q_pos"])[:, None], sliding_window)  # [g, C]
        s = jnp.where(visible[:, None, :], s, MASK_VALUE)
        m_g, l_g, acc_g = _online_softmax_step(
            sl(m), sl(l), sl(acc), s, lambda p: _values(p, v, hkv, group, hd, bd)
        )
        put = jax.lax.dynamic_update_slice_in_dim
        return put(m, m_g, r0, 0), put(l, l_g, r0, 0), put(acc, acc_g, r0, 0)

    init = (
        jnp.full((rows + g, m_rows), MASK_VALUE, jnp.float32),
        jnp.zeros((rows + g, m_rows), jnp.float32),
        jnp.zeros((rows + g, m_rows, hd), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, plan["num_iterations"], body, init)
    out_s = acc[:rows] / jnp.maximum(l[:rows], 1e-30)[..., None]
    return out_s[plan["inverse"]].reshape(rows, hkv, group, hd)


def _tile_attention(q_tile, q_pos0, num_rows, k_cache, v_cache, k_scale, v_scale, table, *, sm_scale,
                    sliding_window, soft_cap, cache_dtype):
    """QUERY_TILE consecutive queries of one sequence, at positions q_pos0 + i:
    q_tile [tile, Hkv, G, hd] -> [tile, Hkv*G, hd]. Rows are laid out (KV head, group,
    tile), so each chunk costs one batched matmul per KV head for scores and values."""
    tile, hkv, group, hd = q_tile.shape
    _, bs, _, _ = k_cache.shape
    nb = _chunk_blocks(bs, KV_CHUNK)
    chunk = nb * bs
    q_pos = q_pos0 + jnp.arange(tile, dtype=jnp.int32)
    kv_end = q_pos0 + num_rows  # exclusive: the last valid query's position + 1
    num_chunks = (kv_end + chunk - 1) // chunk
    first = 0 if sliding_window is None else jnp.maximum(q_pos0 - sliding_window + 1, 0) // chunk
    q = (q_tile.astype(jnp.float32) * sm_scale).transpose(1, 2, 0, 3).reshape(hkv, group * tile, hd)

    def body(j, carry):
        ids = jax.lax.dynamic_slice_in_dim(table, j * nb, nb)
        k = _gather_blocks(k_cache, ids, k_scale, cache_dtype).reshape(chunk, hkv, hd)
        v = _gather_blocks(v_cache, ids, v_scale, cache_dtype).reshape(chunk, hkv, hd)
        s = jnp.einsum("kmd,ckd->kmc", q, k, preferred_element_type=jnp.float32)
        s = apply_soft_cap(s.reshape(hkv, group, tile, chunk), soft_cap)
        k_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = _mask(k_pos[None, :], q_pos[:, None], sliding_window)  # [tile, C]
        s = jnp.where(visible, s, MASK_VALUE)

        def values(p):
            o = jnp.einsum("kmc,ckd->kmd", p.reshape(hkv, group * tile, chunk), v, preferred_element_type=jnp.float32)
            return o.reshape(hkv, group, tile, hd)

        return _online_softmax_step(*carry, s, values)

    init = (
        jnp.full((hkv, group, tile), MASK_VALUE, jnp.float32),
        jnp.zeros((hkv, group, tile), jnp.float32),
        jnp.zeros((hkv, group, tile, hd), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(first, num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.transpose(2, 0, 1, 3).reshape(tile, hkv * group, hd)


def _prefill_plan(kv_lens, query_start_loc, real, num_tokens: int):
    """Per prefill tile (QUERY_TILE rows of one sequence with several new tokens): its
    sequence, first row, valid rows and first query position. From the step's metadata
    only, so XLA computes it once for all layers."""
    qsl = query_start_loc
    q_lens = qsl[1:] - qsl[:-1]
    is_prefill = real & (q_lens > 1)
    tiles_per_seq = jnp.where(is_prefill, (q_lens + QUERY_TILE - 1) // QUERY_TILE, 0)
    tile_ends = jnp.cumsum(tiles_per_seq)
    max_tiles = -(-num_tokens // QUERY_TILE) + kv_lens.shape[0]  # each sequence's last tile may be partial
    seq = _index_of_iteration(tile_ends, max_tiles)
    k = jnp.arange(max_tiles, dtype=jnp.int32) - (tile_ends[seq] - tiles_per_seq[seq])
    return dict(
        seq=seq,
        start=qsl[seq] + k * QUERY_TILE,
        num_rows=jnp.minimum(QUERY_TILE, q_lens[seq] - k * QUERY_TILE),
        q_pos0=kv_lens[seq] - q_lens[seq] + k * QUERY_TILE,
        num_tiles=tile_ends[-1],
    )


def ragged_paged_attention_xla(
    q: Float[Array, "T H hd"],
    k_cache: Shaped[Array, "N B Hkv hd"],
    v_cache: Shaped[Array, "N B Hkv hd"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S MB"],
    query_start_loc: Int[Array, " S+1"],
    num_seqs: Int[Array, ""],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    common_prefix_blocks: Int[Array, ""] | None = None,  # a hint this backend does not use
    k_scale: Float[Array, "N B Hkv"] | None = None,
    v_scale: Float[Array, "N B Hkv"] | None = None,
    cache_dtype: str = "",
) -> Float[Array, "T H hd"]:
    del common_prefix_blocks
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_slots = block_tables.shape[0]
    group = num_heads // num_kv_heads
    blocks_per_chunk = max(_chunk_blocks(block_size, KV_CHUNK), _chunk_blocks(block_size, DECODE_CHUNK))
    tables = _pad_block_tables(block_tables, blocks_per_chunk)
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]
    real = jnp.arange(num_slots) < jnp.reshape(num_seqs, (-1,))[0]
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, cache_dtype=cache_dtype)

    # Prefill chunks: tiles of QUERY_TILE rows, each inside one sequence, written into
    # a fresh buffer (QUERY_TILE rows of slack for the last tile's full-width write).
    tiles = _prefill_plan(kv_lens, qsl, real, num_tokens)
    q_padded = jnp.pad(q, ((0, QUERY_TILE), (0, 0), (0, 0)))

    def tile_body(i, out):
        start, num_rows = tiles["start"][i], tiles["num_rows"][i]
        q_tile = jax.lax.dynamic_slice_in_dim(q_padded, start, QUERY_TILE)
        q_tile = q_tile.reshape(QUERY_TILE, num_kv_heads, group, head_dim)
        table = tables[tiles["seq"][i]]
        o = _tile_attention(q_tile, tiles["q_pos0"][i], num_rows, k_cache, v_cache, k_scale, v_scale, table, **kw)  # [tile, H, D]
        old = jax.lax.dynamic_slice_in_dim(out, start, QUERY_TILE)
        keep_new = (jnp.arange(QUERY_TILE) < num_rows)[:, None, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep_new, o, old), start, axis=0)

    out = jnp.zeros((num_tokens + QUERY_TILE, num_heads, head_dim), jnp.float32)
    out = jax.lax.fori_loop(0, tiles["num_tiles"], tile_body, out)

    # Decodes: every sequence with exactly one new token, vectorized, scattered into
    # their rows.
    is_decode = real & (q_lens == 1)
    decode_q = q[jnp.minimum(qsl[:-1], num_tokens - 1)].reshape(num_slots, num_kv_heads, group, head_dim)
    plan = _decode_plan(kv_lens, tables, is_decode, block_size)
    decode_out = _decode_attention(decode_q, k_cache, v_cache, k_scale, v_scale, plan, **kw)
    decode_rows = jnp.where(is_decode, qsl[:-1], num_tokens + QUERY_TILE)  # out of range: dropped
    out = out.at[decode_rows].set(decode_out.reshape(num_slots, num_heads, head_dim), mode="drop")
    return out[:num_tokens].astype(q.dtype)
