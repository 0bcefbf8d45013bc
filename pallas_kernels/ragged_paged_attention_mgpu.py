"""Ragged paged attention on Pallas's Mosaic GPU backend, for Hopper (issue 66).

The contract is the Triton kernel's (pallas_kernels.ragged_paged_attention; semantics:
pallas_kernels.reference): one launch for a mixed step of chunked-prefill chunks and
decodes over a paged KV cache ``[num_blocks, block_size, num_kv_heads, head_dim]``,
GQA, sliding window, soft cap. Design (docs/kernels.md):

* **Rows.** For KV head ``h`` the queries are laid out as rows: token ``t``'s ``G``
  query heads of KV head ``h`` in rows ``t * Gp .. t * Gp + G - 1`` (``Gp``: G rounded
  up to a power of two, the pad rows zero). A work item is 64 consecutive rows from one
  sequence's first token of the item (``64 / Gp`` tokens; a decode is one item of G
  live rows): one warpgroup's wgmma M. XLA gathers each item's rows before the launch
  (``[Hkv, W, 64, D]``): a TMA box into tiled shared memory must start at a multiple of
  its tiling, and a sequence's rows start anywhere.
* **Grid** ``(Hkv, W)``: the work items of ``ragged_work_items`` (the Triton kernel's
  list); items past the last are marked seq -1 and exit.
* **K/V tiles** of ``block_kv`` positions (whole pages) move by TMA, page by page
  (the page id read from the block table in global memory), into a ``stages``-deep
  ring of shared-memory slots, each page on its own barrier; tile ``j + stages`` is
  issued once tile ``j``'s products have been read. Only the tiles that intersect
  ``[window start, last query position]`` are visited.
* **Products** by wgmma: ``S = Q K^T`` from shared memory into float32 registers,
  masked (causal, sequence end, window, pad rows), online softmax in float32, ``O +=
  P V`` with ``P`` through shared memory as the cache's dtype (Mosaic GPU's interpreter
  runs wgmma on shared-memory operands only, and the CPU proof must run the GPU's code).
  The last tile's V rows past the sequence's horizon are zeroed in shared memory
  first: they may hold anything (another sequence's stale values, NaN), and ``0 * NaN``
  would reach the sums.
* **Output** per work item ``[Hkv, W, 64, D]`` by TMA store (a 64-row box would
  overwrite a neighbouring item's rows in place), gathered back to ``[T, Hq, D]`` by
  XLA; padding rows are zero.

Supported here: q and cache of one dtype, bfloat16 or float16; head_dim a multiple of
64; block_size a multiple of 8 dividing ``block_kv``; G up to 64. ``unsupported``
says why not otherwise, and the engine keeps the Triton kernel for those (float32
queries, float8 / int8 caches, GPUs before Hopper).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.ragged_paged_attention import MASK_VALUE, _next_pow2, ragged_work_items

__all__ = ["ragged_paged_attention_mgpu", "unsupported", "smem_transforms", "ROWS"]

ROWS = 64  # query rows per work item: one warpgroup's wgmma M
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
META = 8  # int32 fields per work item (the row layout of `_work_meta`)


def unsupported(q_dtype, cache_dtype, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, block_kv: int | None = None) -> str | None:
    """Why this kernel cannot serve a configuration (None: it can)."""
    block_kv = block_kv or default_block_kv(block_size)
    if jnp.dtype(q_dtype) not in DTYPES:
        return f"queries of {jnp.dtype(q_dtype).name} (bfloat16 or float16 only)"
    if jnp.dtype(cache_dtype) != jnp.dtype(q_dtype):
        return f"a {jnp.dtype(cache_dtype).name} cache under {jnp.dtype(q_dtype).name} queries"
    if head_dim % 64:
        return f"head_dim {head_dim} (a multiple of 64 only)"
    if num_q_heads % num_kv_heads or _next_pow2(num_q_heads // num_kv_heads) > ROWS:
        return f"{num_q_heads} query heads over {num_kv_heads} KV heads"
    if block_size % 8 or block_kv % block_size or block_kv % 64 or block_kv > 256:
        return f"block_size {block_size} with K/V tiles of {block_kv}"
    return None


def default_block_kv(block_size: int) -> int:
    """K/V positions per tile: 64, or one page where pages are larger (up to 256)."""
    return max(64, block_size)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the kernel body is specialized on."""

    group: int
    g_pad: int
    head_dim: int
    block_size: int
    block_kv: int
    max_blocks: int
    stages: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None

    @property
    def pages(self) -> int:  # pages per K/V tile
        return self.block_kv // self.block_size


def _work_meta(query_start_loc, kv_lens, num_seqs, *, num_tokens: int, block_q: int, g_pad: int,
               block_kv: int, sliding_window: int | None) -> Int[Array, "W 8"]:
    """Per work item: seq (-1: none), its first q row, its tokens, its first query's
    position, the exclusive end of its horizon, its first and last + 1 K/V tile."""
    seq, tile = ragged_work_items(query_start_loc, num_seqs, num_tokens=num_tokens, block_q=block_q)
    valid = seq >= 0
    s = jnp.maximum(seq, 0)
    qsl = query_start_loc.astype(jnp.int32)
    q_start, q_len, kv_len = qsl[s], qsl[s + 1] - qsl[s], kv_lens.astype(jnp.int32)[s]
    tok0 = tile * block_q
    n_tok = jnp.minimum(block_q, q_len - tok0)
    first_pos = kv_len - q_len + tok0
    kv_hi = first_pos + n_tok
    kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - (sliding_window - 1), 0)
    j_lo, j_hi = kv_lo // block_kv, (kv_hi + block_kv - 1) // block_kv
    fields = (jnp.where(valid, seq, -1), (q_start + tok0) * g_pad, n_tok, first_pos, kv_hi, j_lo,
              jnp.where(valid, j_hi, j_lo), 0)
    return jnp.stack([jnp.broadcast_to(jnp.asarray(f, jnp.int32), seq.shape) for f in fields], axis=1)


def smem_transforms(dtype, cols: int) -> tuple:
    """Shared-memory tiling and swizzle for a [rows, cols] tile of `dtype` (a wgmma
    operand, or a TMA box into one; int4 counts half a byte)."""
    bits = 4 if jnp.dtype(dtype) == jnp.int4 else jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(cols * bits, "shared-memory tile")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, p_smem, q_bar, k_bars, v_bars,
            *, st: _Static):
    h, w = lax.axis_index("h"), lax.axis_index("w")
    seq = meta_ref[w, 0]

    @pl.when(seq >= 0)
    def _():
        n_tok, first_pos, kv_hi = meta_ref[w, 2], meta_ref[w, 3], meta_ref[w, 4]
        j_lo, j_hi = meta_ref[w, 5], meta_ref[w, 6]
        plgpu.copy_gmem_to_smem(q_ref.at[h, w], q_smem, q_bar.at[0])

        def fetch(j, slot):
            for i in range(st.pages):
                page_idx = j * st.pages + i  # past the horizon: page 0 (its rows are masked, V's zeroed)
                page = jnp.where(page_idx * st.block_size < kv_hi, bt_ref[seq, jnp.minimum(page_idx, st.max_blocks - 1)], 0)
                rows = pl.ds(i * st.block_size, st.block_size)
                plgpu.copy_gmem_to_smem(k_ref.at[page, :, h], k_smem.at[slot, rows], k_bars.at[slot * st.pages + i])
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, h], v_smem.at[slot, rows], v_bars.at[slot * st.pages + i])

        for s in range(st.stages):
            pl.when(j_lo + s < j_hi)(functools.partial(fetch, j_lo + s, s))
        plgpu.barrier_wait(q_bar.at[0])
        shape = (ROWS, st.block_kv)
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        q_pos = first_pos + rows // st.g_pad
        live = (rows // st.g_pad < n_tok) & (rows % st.g_pad < st.group)

        def step(j, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(j - j_lo, st.stages)
            for i in range(st.pages):
                plgpu.barrier_wait(k_bars.at[slot * st.pages + i])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32)) * st.sm_scale
            if st.soft_cap is not None:
                s = st.soft_cap * jnp.tanh(s / st.soft_cap)
            pos = j * st.block_kv + cols
            mask = live & (pos <= q_pos) & (pos < kv_hi)
            if st.sliding_window is not None:
                mask = mask & (q_pos - pos < st.sliding_window)
            s = jnp.where(mask, s, MASK_VALUE)
            m_next = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp(m_i - m_next)
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_next, shape, [0])), 0.0)
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            for i in range(st.pages):
                plgpu.barrier_wait(v_bars.at[slot * st.pages + i])

            @pl.when(j == j_hi - 1)
            def _zero_past_horizon():
                v_rows = plgpu.broadcasted_iota(jnp.int32, (st.block_kv, st.head_dim), 0, layout=plgpu.Layout.WGMMA)
                v = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
                v_smem.at[slot][...] = jnp.where(j * st.block_kv + v_rows < kv_hi, v, jnp.zeros_like(v))
                plgpu.commit_smem()

            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, st.head_dim), jnp.float32))
            pl.when(j + st.stages < j_hi)(lambda: fetch(j + st.stages, slot))
            return acc, m_next, l_i

        acc = plgpu.layout_cast(jnp.zeros((ROWS, st.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, _, l_i = lax.fori_loop(j_lo, j_hi, step, (acc, m_i, l_i))
        l_i = jnp.where(l_i == 0.0, 1.0, l_i)
        q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[h, w])
        plgpu.wait_smem_to_gmem(0)


def _rows_of_tokens(query_start_loc, num_seqs, *, num_tokens: int, block_q: int, g_pad: int):
    """Per token, the flat row of its first head in the work items' output [W * 64],
    and whether the token is live (not padding)."""
    S = query_start_loc.shape[0] - 1
    n = jnp.reshape(jnp.asarray(num_seqs, jnp.int32), (-1,))[0]
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = jnp.where(jnp.arange(S) < n, jnp.maximum(qsl[1:] - qsl[:-1], 0), 0)
    tiles = (q_lens + block_q - 1) // block_q
    first_item = jnp.cumsum(tiles) - tiles
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    live = (t < qsl[n]) & (seq < n)
    within = t - qsl[seq]
    item = first_item[seq] + within // block_q
    return item * ROWS + (within % block_q) * g_pad, live


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "block_kv",
                                             "stages"))
def ragged_paged_attention_mgpu(
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
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_kv: int | None = None,
    stages: int = 2,
) -> Float[Array, "T H hd"]:
    """Attention of a ragged batch of new tokens over a paged KV cache, on Mosaic GPU
    (the semantics of pallas_kernels.reference.ragged_paged_attention_reference).
    `interpret`: True or an InterpretGPUParams runs Mosaic GPU's interpreter (on a
    CPU; its params can turn on race detection)."""
    if interpret is True:  # Mosaic GPU's own interpreter (Pallas's generic one has no TMA or barriers)
        interpret = plgpu.InterpretGPUParams()
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    S, MB = block_tables.shape
    block_kv = block_kv or default_block_kv(BS)
    why = unsupported(q.dtype, k_cache.dtype, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=BS,
                      block_kv=block_kv)
    if why is not None:
        raise ValueError(f"ragged_paged_attention_mgpu: not for {why}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} {v_cache.dtype} differ")
    group = Hq // Hkv
    g_pad = _next_pow2(group)
    block_q = ROWS // g_pad
    st = _Static(group, g_pad, D, BS, block_kv, MB, stages, float(sm_scale), sliding_window, soft_cap)
    meta = _work_meta(query_start_loc, kv_lens, num_seqs, num_tokens=T, block_q=block_q, g_pad=g_pad,
                      block_kv=block_kv, sliding_window=sliding_window)
    W = meta.shape[0]
    rows = q.reshape(T, Hkv, group, D).transpose(1, 0, 2, 3)
    rows = jnp.pad(rows, ((0, 0), (0, ROWS // g_pad), (0, g_pad - group), (0, 0))).reshape(Hkv, -1, D)
    items = rows[:, meta[:, 1:2] + jnp.arange(ROWS)]  # [Hkv, W, 64, D]: each item's rows, whole boxes for TMA
    tiling = smem_transforms(q.dtype, D)
    out = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=jax.ShapeDtypeStruct((Hkv, W, ROWS, D), q.dtype),
        grid=(Hkv, W),
        grid_names=("h", "w"),
        scratch_types=[
            plgpu.SMEM((ROWS, D), q.dtype, transforms=tiling),
            plgpu.SMEM((stages, block_kv, D), q.dtype, transforms=tiling),
            plgpu.SMEM((stages, block_kv, D), q.dtype, transforms=tiling),
            plgpu.SMEM((ROWS, block_kv), q.dtype, transforms=smem_transforms(q.dtype, block_kv)),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=stages * st.pages),
            plgpu.Barrier(num_barriers=stages * st.pages),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
        kernel_name=f"ragged_paged_attention_mgpu_g{group}_bkv{block_kv}",
    )(meta, block_tables.astype(jnp.int32), items, k_cache, v_cache)
    first_row, live = _rows_of_tokens(query_start_loc, num_seqs, num_tokens=T, block_q=block_q, g_pad=g_pad)
    idx = first_row[:, None] + jnp.arange(group)  # [T, G]
    got = out.reshape(Hkv, W * ROWS, D)[:, idx]  # [Hkv, T, G, D]
    got = jnp.where(live[None, :, None, None], got, 0).transpose(1, 0, 2, 3)
    return got.reshape(T, Hq, D)

