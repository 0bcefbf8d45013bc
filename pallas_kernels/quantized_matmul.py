"""Weight-only quantized matmul for GPU: ``y[M, N] = x[M, K] @ W[K, N]`` with ``W`` held
as int8 values and float32 scales (jaxllm.models.quant's QuantizedWeight), dequantized
tile by tile inside one Pallas (Triton) launch, so the weights cross HBM as one byte
each instead of being converted to a bfloat16 copy first.

Formats (``group`` and ``mins`` say which):

* **per column** (``group=0``: jaxllm's ``int8``): ``W = q * scale[N]``. The tiles
  multiply the int8 values (exact in bfloat16 and float32) and the finished
  accumulator is scaled by its columns.
* **grouped** (``group=32``: GGUF's Q8_0, Q4_0 (values ``nibble - 8``), Q4_1 with
  ``mins``): ``W[k, n] = q[k, n] * scale[k // 32, n] (+ mins[k // 32, n])``. One K step
  is one group, so each step scales (and shifts) its whole ``[32, block_n]`` tile by one
  row of scales, in float32, rounded once to x's dtype for the MMA.

Design: grid ``(cdiv(M, block_m), cdiv(N, block_n), split_k)``; program ``(i, j, s)``
walks its ``1 / split_k`` of K in steps of ``block_k`` (``group`` when grouped, else
the largest power of two up to 64 dividing K), loading an x tile ``[block_m,
block_k]`` and a value tile ``[block_k, block_n]`` through masked gathers (rows past M and columns past N read zeros and are
never stored), converting the values to float32, scaling, casting to x's dtype, and
accumulating ``tl.dot`` in float32. With ``split_k`` > 1 each program stores its
float32 partial sums ``[split_k, M, N]`` and XLA adds them: more programs for a
decode-sized M over a long K (the down projection: 32 column tiles for 132
multiprocessors without it). Whole-array refs and explicit gathers, as the
attention kernel does: M, N and K need not be powers of two (K must divide into
steps), only the tiles are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int8

from pallas_kernels.ragged_paged_attention import MIN_MMA, Q_DTYPES, _is_pow2

__all__ = ["quantized_matmul", "quantized_matmul_reference", "default_blocks", "build_quantized_matmul_call"]


def quantized_matmul_reference(
    x: Float[Array, "M K"], q: Int8[Array, "K N"], scale: Float[Array, " N"] | Float[Array, "G N"],
    mins: Float[Array, "G N"] | None = None, *, group: int = 0,
) -> Float[Array, "M N"]:
    """The oracle: ``x @ W`` in float32 over the dequantized matrix (each weight
    ``q * scale`` rounded once, then ``+ min``, as jaxllm.models.quant.dequantize
    computes it), returned in x's dtype."""
    w = q.astype(jnp.float32)
    if group:
        w = w * jnp.repeat(scale, group, axis=0)
        if mins is not None:
            w = w + jnp.repeat(mins, group, axis=0)
    y = jnp.matmul(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    if not group:
        y = y * scale
    return y.astype(x.dtype)


def default_blocks(m: int, n: int, k: int, group: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): 16 rows for decode-sized M (the MMA minimum), up
    to 64 for prefill; 64 columns (128 when N is large); a K step of one group, or the
    largest power of two <= 64 dividing K (at least 16)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 128 if n >= 4096 else 64
    if group:
        return block_m, block_n, group
    block_k = 64
    while block_k > MIN_MMA and k % block_k:
        block_k //= 2
    return block_m, block_n, block_k


def _check(k: int, group: int, block_m: int, block_n: int, block_k: int, dtype, split_k: int = 1) -> None:
    if jnp.dtype(dtype) not in Q_DTYPES:
        raise ValueError(f"quantized_matmul: x must be one of {[d.name for d in Q_DTYPES]}, got {jnp.dtype(dtype)}")
    for name, val in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not _is_pow2(val) or val < MIN_MMA:
            raise ValueError(f"quantized_matmul: {name}={val} must be a power of two >= {MIN_MMA} "
                             "(Triton block shapes, tl.dot minimum)")
    if group and block_k != group:
        raise ValueError(f"quantized_matmul: grouped scales need block_k == group ({group}), got {block_k}")
    if k % block_k:
        raise ValueError(f"quantized_matmul: K={k} is not a multiple of block_k={block_k}")
    if split_k < 1 or (k // block_k) % split_k:
        raise ValueError(f"quantized_matmul: split_k={split_k} must divide the {k // block_k} steps of "
                         f"block_k={block_k} over K={k}")


def _qmm_kernel(x_ref, q_ref, s_ref, *rest, m: int, n: int, k: int, group: int, has_mins: bool,
                block_m: int, block_n: int, block_k: int, split_k: int, precision):
    if has_mins:
        mins_ref, o_ref = rest
    else:
        (o_ref,) = rest
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m, cols < n
    # Rows past M and columns past N read row / column 0 (always there) and are never stored.
    rows_in, cols_in = jnp.where(row_ok, rows, 0), jnp.where(col_ok, cols, 0)

    def body(step, acc):
        ks = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        x = plgpu.load(x_ref.at[rows_in[:, None], ks[None, :]])
        w = plgpu.load(q_ref.at[ks[:, None], cols_in[None, :]]).astype(jnp.float32)
        if group:  # one group per step: one row of scales (and mins)
            w = w * plgpu.load(s_ref.at[step, cols_in])[None, :]
            if has_mins:
                w = w + plgpu.load(mins_ref.at[step, cols_in])[None, :]
        return acc + lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    steps = k // block_k // split_k  # this program's share of K
    first = pl.program_id(2) * steps
    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    if not group:
        acc = acc * plgpu.load(s_ref.at[cols_in])[None, :]
    # Stored rows / columns past the end point one past it: masked on the GPU, dropped by
    # the interpreter's scatter (never aliased with a real element, as clamped ones would be).
    rows_out, cols_out = jnp.where(row_ok, rows, m), jnp.where(col_ok, cols, n)
    idx = (rows_out[:, None], cols_out[None, :])
    if split_k > 1:  # partial sums: [split_k, M, N]
        idx = (pl.program_id(2),) + idx
    plgpu.store(o_ref.at[idx], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def build_quantized_matmul_call(*, m: int, n: int, k: int, group: int, has_mins: bool, dtype, block_m: int,
                                block_n: int, block_k: int, out_dtype=None, num_warps: int = 4, num_stages: int = 2,
                                split_k: int = 1, interpret: bool = False):
    """The raw ``pallas_call`` (no validation): ``(x, q, scale[, mins]) -> y [m, n]``
    of `out_dtype` (default: x's, `dtype`), or with `split_k` > 1 float32 partial sums
    ``[split_k, m, n]``. Exposed for the lowering tests."""
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(_qmm_kernel, m=m, n=n, k=k, group=group, has_mins=has_mins, block_m=block_m,
                               block_n=block_n, block_k=block_k, split_k=split_k, precision=precision)
    fmt = f"g{group}{'m' if has_mins else ''}" if group else "col"
    out_dtype = dtype if out_dtype is None else out_dtype
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n), split_k),
        out_shape=(jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if split_k > 1
                   else jax.ShapeDtypeStruct((m, n), out_dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"quantized_matmul_{fmt}_bm{block_m}_bn{block_n}_bk{block_k}" + (f"_sk{split_k}" if split_k > 1 else ""),
    )


@functools.partial(jax.jit, static_argnames=("group", "block_m", "block_n", "block_k", "split_k", "num_warps",
                                             "num_stages", "out_dtype", "interpret"))
def quantized_matmul(
    x: Float[Array, "M K"], q: Int8[Array, "K N"], scale: Float[Array, " N"] | Float[Array, "G N"],
    mins: Float[Array, "G N"] | None = None, *, group: int = 0, block_m: int | None = None,
    block_n: int | None = None, block_k: int | None = None, split_k: int = 1, num_warps: int | None = None,
    num_stages: int = 2, out_dtype=None, interpret: bool = False,
) -> Float[Array, "M N"]:
    """``x @ W`` for ``W`` as int8 values ``q`` [K, N] with float32 scales: one per
    column (``group=0``) or per ``group`` inputs of each column (``scale`` [K / group,
    N], and ``mins`` alike for Q4_1). Accumulates in float32; returns `out_dtype`
    (default x's: float32 for logits from bfloat16 activations). `split_k` > 1 splits
    K over that many programs per output tile, their float32 partial sums added after
    (the tiles and `split_k` are for scripts/bench_quantized_matmul.py's sweep: the
    defaults are the ones measured, docs/kernels.md)."""
    (m, k), n = x.shape, q.shape[1]
    if q.shape[0] != k or q.dtype != jnp.int8:
        raise ValueError(f"quantized_matmul: q must be int8 [K={k}, N], got {q.dtype} {q.shape}")
    expected = (k // group, n) if group else (n,)
    if group and k % group:
        raise ValueError(f"quantized_matmul: K={k} is not a multiple of the group ({group})")
    if scale.shape != expected or (mins is not None and mins.shape != expected):
        raise ValueError(f"quantized_matmul: scales (and mins) must be {expected}, got {scale.shape}"
                         + ("" if mins is None else f" and {mins.shape}"))
    if mins is not None and not group:
        raise ValueError("quantized_matmul: mins need grouped scales")
    bm, bn, bk = default_blocks(m, n, k, group)
    block_m, block_n, block_k = block_m or bm, block_n or bn, block_k or bk
    _check(k, group, block_m, block_n, block_k, x.dtype, split_k)
    call = build_quantized_matmul_call(
        m=m, n=n, k=k, group=group, has_mins=mins is not None, dtype=x.dtype, out_dtype=out_dtype,
        block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_stages=num_stages,
        num_warps=num_warps or (8 if block_m * block_n >= 64 * 128 else 4), interpret=interpret)
    args = (x, q, scale.astype(jnp.float32)) + (() if mins is None else (mins.astype(jnp.float32),))
    if split_k == 1:
        return call(*args)
    return call(*args).sum(axis=0).astype(x.dtype if out_dtype is None else out_dtype)
