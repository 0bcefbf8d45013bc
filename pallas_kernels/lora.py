"""Batched LoRA for GPU (Punica's shrink and expand, segmented by adapter slot): each
token ``m`` of a step runs through the adapter in its slot, ``y[m] = x[m] @ A[s] @
B[s]`` with ``s = slots[m] - 1`` (slot 0: no adapter, zeros), many adapters in one
launch and no token paying for an adapter that is not its own.

* ``lora_shrink(x [M, K], a [K, L, P, R], slots [M]) -> [M, P, R]`` (float32): every
  part ``p`` of a fused projection (q | k | v, gate | up) has its own A.
* ``lora_expand(s [M, R], b [L, R, N], slots [M]) -> [M, N]`` (x's dtype): one part.

Design (as pallas_kernels.quantized_matmul): whole-array refs and masked gathers, so M,
K and N need not be powers of two, only the tiles. Shrink: grid ``(cdiv(M, block_m),
P)``; program ``(i, p)`` loops over the L slots, and for a slot some row of its tile
holds (``lax.cond``: the others cost a test) walks K in ``block_k`` steps, ``tl.dot``
of the x tile and that slot's A tile, keeping the rows of that slot. Expand: grid
``(cdiv(M, block_m), cdiv(N, block_n))``; the tile's [block_m, R] shrunk rows times
each present slot's B tile, kept for that slot's rows. R is the rank of the slots (the
engine's max_lora_rank, zero-padded adapters): a power of two >= 16 (``tl.dot``).
The oracle is ``lora_reference``, the jnp computation the XLA path runs
(jaxllm.models.lora).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.quantized_matmul import default_blocks
from pallas_kernels.ragged_paged_attention import MIN_MMA, Q_DTYPES, _is_pow2

__all__ = ["lora_shrink", "lora_expand", "lora_reference"]


def lora_reference(x: Float[Array, "M K"], a: Float[Array, "K L P R"], bs: tuple[Float[Array, "L R _"], ...],
                   slots: Int[Array, " M"]) -> Float[Array, "M NP"]:
    """The oracle: each row through its slot's A and B (zeros for slot 0), every part's
    columns concatenated, in float32, returned in x's dtype."""
    m, k = x.shape
    _, num_slots, _, rank = a.shape
    onehot = (slots[:, None] == jnp.arange(1, num_slots + 1)).astype(jnp.float32)
    shrunk = jnp.einsum("mk,klpr->mlpr", x.astype(jnp.float32), a.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * onehot[:, :, None, None]
    outs = [jnp.einsum("mlr,lrn->mn", shrunk[:, :, p], b.astype(jnp.float32), precision=lax.Precision.HIGHEST)
            for p, b in enumerate(bs)]
    return jnp.concatenate(outs, axis=-1).astype(x.dtype)


def _check(name: str, rank: int, dtype, tiles: dict[str, int], k: int | None = None) -> None:
    """x's dtype, the slots' rank and the tiles as ``tl.dot`` takes them; K whole steps."""
    if jnp.dtype(dtype) not in Q_DTYPES:
        raise ValueError(f"{name}: x must be one of {[d.name for d in Q_DTYPES]}, got {jnp.dtype(dtype)}")
    if not _is_pow2(rank) or rank < MIN_MMA:
        raise ValueError(f"{name}: the rank of the slots ({rank}) must be a power of two >= {MIN_MMA} (tl.dot); "
                         "zero-pad the adapters to it")
    for label, val in tiles.items():
        if not _is_pow2(val) or val < MIN_MMA:
            raise ValueError(f"{name}: {label}={val} must be a power of two >= {MIN_MMA}")
    if k is not None and k % tiles["block_k"]:
        raise ValueError(f"{name}: K={k} is not a multiple of block_k={tiles['block_k']}")


def _rows(m: int, block_m: int):
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    ok = rows < m
    return ok, jnp.where(ok, rows, 0), jnp.where(ok, rows, m)  # in range; read (clamped); stored (past: dropped)


def _shrink_kernel(x_ref, a_ref, slots_ref, o_ref, *, m: int, k: int, num_slots: int, rank: int, block_m: int,
                   block_k: int, precision):
    ok, rows_in, rows_out = _rows(m, block_m)
    part = pl.program_id(1)
    slots = jnp.where(ok, plgpu.load(slots_ref.at[rows_in]), 0)
    ranks = jnp.arange(rank, dtype=jnp.int32)

    def one_slot(slot: int, acc):
        mine = slots == slot + 1

        def product():
            def body(step, acc_k):
                ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
                x = plgpu.load(x_ref.at[rows_in[:, None], ks[None, :]])
                w = plgpu.load(a_ref.at[ks[:, None], slot, part, ranks[None, :]])
                return acc_k + lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())), precision=precision,
                                               preferred_element_type=jnp.float32)
            return lax.fori_loop(0, k // block_k, body, jnp.zeros((block_m, rank), jnp.float32))

        # (max, not jnp.any: reduce_or has no Pallas Triton lowering)
        got = lax.cond(jnp.max(mine.astype(jnp.int32)) > 0, product, lambda: jnp.zeros((block_m, rank), jnp.float32))
        return acc + jnp.where(mine[:, None], got, 0.0)

    acc = jnp.zeros((block_m, rank), jnp.float32)
    for slot in range(num_slots):
        acc = one_slot(slot, acc)
    plgpu.store(o_ref.at[rows_out[:, None], part, ranks[None, :]], acc, mask=ok[:, None])


def _expand_kernel(s_ref, b_ref, slots_ref, o_ref, *, m: int, n: int, num_slots: int, rank: int, block_m: int,
                   block_n: int, precision):
    ok, rows_in, rows_out = _rows(m, block_m)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n
    cols_in, cols_out = jnp.where(col_ok, cols, 0), jnp.where(col_ok, cols, n)
    slots = jnp.where(ok, plgpu.load(slots_ref.at[rows_in]), 0)
    ranks = jnp.arange(rank, dtype=jnp.int32)
    s = plgpu.load(s_ref.at[rows_in[:, None], ranks[None, :]])
    acc = jnp.zeros((block_m, block_n), jnp.float32)
    for slot in range(num_slots):
        mine = slots == slot + 1

        def product(slot=slot):
            w = plgpu.load(b_ref.at[slot, ranks[:, None], cols_in[None, :]])
            return lax.dot_general(s.astype(w.dtype), w, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

        got = lax.cond(jnp.max(mine.astype(jnp.int32)) > 0, product, lambda: jnp.zeros((block_m, block_n), jnp.float32))
        acc = acc + jnp.where(mine[:, None], got, 0.0)
    plgpu.store(o_ref.at[rows_out[:, None], cols_out[None, :]], acc.astype(o_ref.dtype),
                mask=ok[:, None] & col_ok[None, :])


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "interpret"))
def lora_shrink(x: Float[Array, "M K"], a: Float[Array, "K L P R"], slots: Int[Array, " M"], *,
                block_m: int | None = None, block_k: int | None = None, interpret: bool = False
                ) -> Float[Array, "M P R"]:
    """Each row of x times its slot's A, for every part: [M, P, R] float32 (zeros for
    the rows of slot 0)."""
    (m, k), (ka, num_slots, parts, rank) = x.shape, a.shape
    if ka != k:
        raise ValueError(f"lora_shrink: a must be [K={k}, L, P, R], got {a.shape}")
    bm, _, bk = default_blocks(m, 1, k, 0)  # the quantized matmul's tiles: rows by M, the K step dividing K
    block_m, block_k = block_m or bm, block_k or bk
    _check("lora_shrink", rank, x.dtype, {"block_m": block_m, "block_k": block_k}, k)
    kernel = functools.partial(_shrink_kernel, m=m, k=k, num_slots=num_slots, rank=rank, block_m=block_m,
                               block_k=block_k, precision=_precision(x.dtype))
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), parts),
        out_shape=jax.ShapeDtypeStruct((m, parts, rank), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name=f"lora_shrink_l{num_slots}_p{parts}_r{rank}_bm{block_m}_bk{block_k}",
    )(x, a.astype(x.dtype), slots.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "interpret"))
def lora_expand(s: Float[Array, "M R"], b: Float[Array, "L R N"], slots: Int[Array, " M"], *, out_dtype=None,
                block_m: int | None = None, block_n: int | None = None, interpret: bool = False
                ) -> Float[Array, "M N"]:
    """Each shrunk row times its slot's B: [M, N] of `out_dtype` (default: b's)."""
    (m, rank), (num_slots, rank_b, n) = s.shape, b.shape
    if rank_b != rank:
        raise ValueError(f"lora_expand: b must be [L, R={rank}, N], got {b.shape}")
    bm, bn, _ = default_blocks(m, n, rank, 0)
    block_m, block_n = block_m or bm, block_n or bn
    _check("lora_expand", rank, b.dtype, {"block_m": block_m, "block_n": block_n})
    kernel = functools.partial(_expand_kernel, m=m, n=n, num_slots=num_slots, rank=rank, block_m=block_m,
                               block_n=block_n, precision=_precision(b.dtype))
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or b.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name=f"lora_expand_l{num_slots}_r{rank}_bm{block_m}_bn{block_n}",
    )(s, b, slots.astype(jnp.int32))
