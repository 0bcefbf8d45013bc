"""Ragged paged attention for GPU: one Pallas (Triton) launch for a whole mixed step.

Chunked-prefill chunks and single-token decodes of many sequences arrive as one flat,
ragged batch of query rows ``q[T, num_q_heads, head_dim]``; their keys/values live in a
paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` reached through a block
table. This kernel serves all of it in one ``pallas_call``. Design (docs/kernels.md):

* **Work items.** The ragged query rows are cut into *query tiles* of ``block_q``
  consecutive tokens of one sequence (a decode sequence is one tile holding one token).
  A few jnp ops before the launch list the tiles as ``(seq, tile index)`` pairs; the
  list has a static length ``W`` (an upper bound derived from ``T`` and ``S``), the
  unused tail is marked ``seq = -1`` and those programs exit at once.
* **Grid** ``(num_kv_heads, W)``: program ``(h, w)`` computes all ``G = Hq / Hkv`` query
  heads of KV head ``h`` for the tokens of tile ``w``. Its query block has
  ``M = block_q * next_pow2(G)`` rows (row ``r`` = token ``r // G'``, head ``r % G'``),
  so K/V are read once per GQA group and a decode with G=4 still fills a 16-row MMA.
* **K/V tiles** of ``block_kv`` positions are fetched through the block table (a gather
  of page ids per position, then a gather of K/V rows), masked beyond the sequence's
  causal horizon, and folded in with an online softmax in float32.
* Only K/V tiles that intersect ``[window start, last query position]`` are visited.
* **Quantized caches.** The cache may hold float32, bfloat16, float16, float8_e4m3fn or
  int8 elements, whatever q's dtype (float32, bfloat16 or float16). A K/V tile whose
  dtype is not q's is widened to float32 -- for int8 times its rows' scales, loaded
  through the same slots (``k_scale`` / ``v_scale`` ``[num_blocks, block_size,
  num_kv_heads]``) -- and cast to q's dtype for the dots. When the cache's dtype is q's
  the kernel is the unquantized one: no conversion, no scale inputs.

Everything is whole-array refs plus explicit (masked) gathers/scatters, which is what
the Pallas Triton lowering handles well for data-dependent addressing; the same code
runs with ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.reference import SCALED_CACHE_DTYPE, check_kv_cache_scales

__all__ = [
    "ragged_paged_attention",
    "ragged_work_items",
    "default_block_q",
    "default_block_kv",
    "num_work_items",
    "Q_DTYPES",
]

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_MMA = 16  # Triton tl.dot needs every dimension >= 16.
# q (and output) dtypes; the cache's are reference.CACHE_DTYPES.
Q_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def default_block_q(num_q_heads: int, num_kv_heads: int, num_tokens: int,
                    max_num_seqs: int | None = None) -> int:
    """Query tokens per tile.

    Rows of the query block are ``block_q * next_pow2(G)``. Aim for 64 rows (good MMA
    shapes for prefill), but 16 rows -- the MMA minimum -- when the bucket has no
    more tokens than sequences (``T <= S``: decode-dominated, where extra rows would
    be padding and only waste issue slots). Never larger than the batch itself.
    """
    g_pad = _next_pow2(num_q_heads // num_kv_heads)
    decode_bucket = max_num_seqs is not None and num_tokens <= max_num_seqs
    target_rows = MIN_MMA if decode_bucket else 64
    bq = max(1, target_rows // g_pad)
    bq = min(bq, _next_pow2(num_tokens))
    while bq * g_pad < MIN_MMA:
        bq *= 2
    return bq


def default_block_kv(block_size: int, head_dim: int) -> int:
    """K/V positions per tile: 64 (32 for head_dim > 128, to bound shared memory),
    and at least one whole page. Always a power of two >= 16."""
    target = 64 if head_dim <= 128 else 32
    return max(target, _next_pow2(block_size))


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a power of two >= 16 (masked lanes are zero)."""
    return max(MIN_MMA, _next_pow2(head_dim))


def num_work_items(num_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static upper bound on the number of query tiles.

    Sequence s with q_s tokens has ceil(q_s / block_q) tiles; summed over the n <=
    min(S, T) non-empty sequences that is <= (T + n * (block_q - 1)) / block_q, and
    every tile holds at least one token so it is also <= T.
    """
    n = min(max_num_seqs, num_tokens)
    return max(1, min(num_tokens, (num_tokens + n * (block_q - 1)) // block_q))


def ragged_work_items(
    query_start_loc: Int[Array, " S1"],  # S + 1 offsets (S itself is not an argument here)
    num_seqs: Int[Array, ""] | Int[Array, 1] | int,
    *,
    num_tokens: int,
    block_q: int,
) -> tuple[Int[Array, " W"], Int[Array, " W"]]:
    """List the query tiles of a ragged batch as (seq id, tile index within the seq).

    Entries past the real number of tiles have seq id -1. Padding sequences
    (index >= num_seqs) and empty ones (q_len == 0) get no tiles.
    """
    S = query_start_loc.shape[0] - 1
    W = num_work_items(num_tokens, S, block_q)
    n = jnp.reshape(jnp.asarray(num_seqs, jnp.int32), (-1,))[0]
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = jnp.maximum(qsl[1:] - qsl[:-1], 0)
    q_lens = jnp.where(jnp.arange(S, dtype=jnp.int32) < n, q_lens, 0)
    tiles = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(tiles)  # tile w belongs to the first s with ends[s] > w
    w = jnp.arange(W, dtype=jnp.int32)
    seq = jnp.sum(ends[None, :] <= w[:, None], axis=1).astype(jnp.int32)
    valid = w < ends[-1]
    seq_c = jnp.minimum(seq, S - 1)
    tile = w - (ends[seq_c] - tiles[seq_c])
    return jnp.where(valid, seq_c, -1), jnp.where(valid, tile, 0).astype(jnp.int32)


def _rpa_kernel(
    # inputs (all whole-array refs)
    work_seq_ref,  # [W] int32
    work_tile_ref,  # [W] int32
    qsl_ref,  # [S+1] int32
    kv_lens_ref,  # [S] int32
    bt_ref,  # [S, MB] int32
    q_ref,  # [T * Hq, D]
    k_ref,  # [NB * BS, Hkv, D]
    v_ref,  # [NB * BS, Hkv, D]
    *refs,  # int8 cache: k_scale_ref, v_scale_ref ([NB * BS, Hkv] float32); then o_ref [T * Hq, D]
    scaled: bool,
    num_tokens: int,
    num_q_heads: int,
    group: int,
    g_pad: int,
    head_dim: int,
    d_pad: int,
    block_q: int,
    block_kv: int,
    block_size: int,
    max_blocks: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    precision,
):
    if scaled:
        ks_ref, vs_ref, o_ref = refs
    else:
        (o_ref,) = refs
    h = pl.program_id(0)
    w = pl.program_id(1)
    seq = work_seq_ref[w]

    @pl.when(seq >= 0)
    def _():
        tile = work_tile_ref[w]
        seq_q_start = qsl_ref[seq]
        q_len = qsl_ref[seq + 1] - seq_q_start
        kv_len = kv_lens_ref[seq]
        tok0 = tile * block_q  # first token of this tile, counted within the sequence
        n_tok = jnp.minimum(block_q, q_len - tok0)
        first_pos = kv_len - q_len + tok0  # absolute position of the tile's first query
        kv_hi = first_pos + n_tok  # exclusive: last query position + 1 (<= kv_len)

        m_rows = block_q * g_pad
        r = jnp.arange(m_rows, dtype=jnp.int32)
        t = r // g_pad
        g = r % g_pad
        row_valid = t < n_tok
        if g_pad != group:
            row_valid = row_valid & (g < group)
        # Flat row in q / o viewed as [T * Hq, D]. Invalid rows point one past the end:
        # masked on the GPU, dropped by the interpreter's scatter (never aliased).
        row = (seq_q_start + tok0 + t) * num_q_heads + h * group + g
        row = jnp.where(row_valid, row, num_tokens * num_q_heads)
        q_pos = first_pos + t

        d = jnp.arange(d_pad, dtype=jnp.int32)
        if d_pad != head_dim:
            d_valid = d < head_dim
            q_mask = row_valid[:, None] & d_valid[None, :]
        else:
            d_valid = None
            q_mask = row_valid[:, None]
        q = plgpu.load(q_ref.at[row[:, None], d[None, :]], mask=q_mask, other=0)

        # The value of masked K/V lanes. The Triton lowering casts an int `other` to
        # integer and 16/32-bit float pointees but not to float8: give fp8 a float zero.
        kv_other = 0.0 if k_ref.dtype == jnp.float8_e4m3fn else 0

        def widen(x, scale):
            """A K/V tile as q's dtype: through float32, times its rows' scales if any."""
            if scale is None and x.dtype == q.dtype:
                return x  # unquantized: the tile is used as loaded
            x = x.astype(jnp.float32)
            if scale is not None:
                x = x * scale[:, None]
            return x.astype(q.dtype)

        if sliding_window is None:
            kv_lo = 0
        else:
            kv_lo = jnp.maximum(first_pos - (sliding_window - 1), 0)
        j_lo = kv_lo // block_kv
        j_hi = (kv_hi + block_kv - 1) // block_kv

        def body(j, carry):
            acc, m_prev, l_prev = carry
            pos = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            kv_valid = pos < kv_hi
            page = jnp.minimum(pos // block_size, max_blocks - 1)
            blk = plgpu.load(bt_ref.at[seq, page], mask=kv_valid, other=0)
            slot = blk * block_size + pos % block_size
            kv_mask = kv_valid[:, None]
            if d_valid is not None:
                kv_mask = kv_mask & d_valid[None, :]
            k = plgpu.load(k_ref.at[slot[:, None], h, d[None, :]], mask=kv_mask, other=kv_other)
            v = plgpu.load(v_ref.at[slot[:, None], h, d[None, :]], mask=kv_mask, other=kv_other)
            if scaled:
                k_sc = plgpu.load(ks_ref.at[slot, h], mask=kv_valid, other=0)
                v_sc = plgpu.load(vs_ref.at[slot, h], mask=kv_valid, other=0)
            else:
                k_sc = v_sc = None
            k = widen(k, k_sc)
            v = widen(v, v_sc)

            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = (pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
            if sliding_window is not None:
                mask = mask & (q_pos[:, None] - pos[None, :] < sliding_window)
            s = jnp.where(mask, s, MASK_VALUE)

            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
            l_next = alpha * l_prev + jnp.sum(p, axis=1)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )
            return alpha[:, None] * acc + pv, m_next, l_next

        acc0 = jnp.zeros((m_rows, d_pad), jnp.float32)
        m0 = jnp.full((m_rows,), MASK_VALUE, jnp.float32)
        l0 = jnp.zeros((m_rows,), jnp.float32)
        acc, _, l = lax.fori_loop(j_lo, j_hi, body, (acc0, m0, l0))
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        plgpu.store(o_ref.at[row[:, None], d[None, :]], out.astype(o_ref.dtype), mask=q_mask)


def _check_config(*, m_rows: int, block_kv: int, d_pad: int) -> None:
    for name, val in (("query rows (block_q * next_pow2(G))", m_rows),
                      ("block_kv", block_kv), ("padded head_dim", d_pad)):
        if not _is_pow2(val):
            raise ValueError(f"{name}={val} must be a power of two (Triton block shapes)")
        if val < MIN_MMA:
            raise ValueError(f"{name}={val} must be >= {MIN_MMA} (tl.dot minimum)")


def build_ragged_paged_attention_call(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_slots: int,
    block_size: int,
    max_blocks: int,
    num_work: int,
    dtype,
    block_q: int,
    block_kv: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    cache_dtype=None,
):
    """The raw ``pallas_call`` (no validation). Exposed for the lowering tests.

    ``dtype`` is q's (and the output's); ``cache_dtype`` the K/V cache's (default:
    ``dtype``). An int8 cache's call takes ``k_scale, v_scale`` ([num_slots, Hkv]
    float32) after the caches; other caches' calls take no scales.
    """
    cache_dtype = jnp.dtype(dtype if cache_dtype is None else cache_dtype)
    scaled = cache_dtype == SCALED_CACHE_DTYPE
    group = num_q_heads // num_kv_heads
    g_pad = _next_pow2(group)
    d_pad = padded_head_dim(head_dim)
    precision = (lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32
                 else lax.Precision.DEFAULT)
    kernel = functools.partial(
        _rpa_kernel,
        scaled=scaled, num_tokens=num_tokens, num_q_heads=num_q_heads, group=group, g_pad=g_pad,
        head_dim=head_dim, d_pad=d_pad, block_q=block_q, block_kv=block_kv,
        block_size=block_size, max_blocks=max_blocks, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=soft_cap, precision=precision,
    )
    del num_slots
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_work),
        out_shape=jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{block_q}_g{group}_bkv{block_kv}_kv{cache_dtype.name}",
    )


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "block_q",
                     "block_kv", "num_warps", "num_stages"),
)
def ragged_paged_attention(
    q: Float[Array, "T H hd"],
    k_cache: Shaped[Array, "N B Hkv hd"],
    v_cache: Shaped[Array, "N B Hkv hd"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S MB"],
    query_start_loc: Int[Array, " S+1"],
    num_seqs: Int[Array, ""] | Int[Array, 1] | int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    k_scale: Float[Array, "N B Hkv"] | None = None,
    v_scale: Float[Array, "N B Hkv"] | None = None,
) -> Float[Array, "T H hd"]:
    """Attention of a ragged batch of new tokens over a paged KV cache.

    See ``pallas_kernels.reference.ragged_paged_attention_reference`` for the exact
    semantics (this kernel matches it on every non-padding row). ``block_q`` (query
    tokens per tile), ``block_kv`` (K/V positions per tile), ``num_warps`` and
    ``num_stages`` are tuning knobs; defaults come from :func:`default_block_q` and
    :func:`default_block_kv`.

    q is float32, bfloat16 or float16 (the output has its dtype); the caches hold any
    of ``reference.CACHE_DTYPES``. An int8 cache needs ``k_scale`` / ``v_scale``
    (float32 ``[num_blocks, block_size, num_kv_heads]``: an element reads as its value
    times its row's scale); no other cache takes them.
    """
    T, Hq, D = q.shape
    NB, BS, Hkv, Dk = k_cache.shape
    S, MB = block_tables.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and cache ({Dk}) differ")
    if Hq % Hkv:
        raise ValueError(f"num_q_heads={Hq} is not a multiple of num_kv_heads={Hkv}")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {', '.join(d.name for d in Q_DTYPES)}")
    scaled = check_kv_cache_scales(k_cache, v_cache, k_scale, v_scale)
    if kv_lens.shape != (S,) or query_start_loc.shape != (S + 1,):
        raise ValueError("kv_lens must be [S] and query_start_loc [S+1] for "
                         f"block_tables [S, MB]; got {kv_lens.shape}, {query_start_loc.shape}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    group = Hq // Hkv
    if block_q is None:
        block_q = default_block_q(Hq, Hkv, T, S)
    if block_kv is None:
        block_kv = default_block_kv(BS, D)
    m_rows = block_q * _next_pow2(group)
    d_pad = padded_head_dim(D)
    _check_config(m_rows=m_rows, block_kv=block_kv, d_pad=d_pad)
    if num_warps is None:
        num_warps = 8 if m_rows * d_pad >= 128 * 128 else 4

    work_seq, work_tile = ragged_work_items(
        query_start_loc, num_seqs, num_tokens=T, block_q=block_q)
    call = build_ragged_paged_attention_call(
        num_tokens=T, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, num_slots=NB * BS,
        block_size=BS, max_blocks=MB, num_work=work_seq.shape[0], dtype=q.dtype,
        block_q=block_q, block_kv=block_kv, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, cache_dtype=k_cache.dtype,
    )
    scales = ((k_scale.astype(jnp.float32).reshape(NB * BS, Hkv),
               v_scale.astype(jnp.float32).reshape(NB * BS, Hkv)) if scaled else ())
    out = call(
        work_seq, work_tile,
        query_start_loc.astype(jnp.int32), kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q.reshape(T * Hq, D),
        k_cache.reshape(NB * BS, Hkv, D), v_cache.reshape(NB * BS, Hkv, D),
        *scales,
    )
    return out.reshape(T, Hq, D)
