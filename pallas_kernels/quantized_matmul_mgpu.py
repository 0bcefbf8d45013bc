"""Weight-only quantized matmul on Pallas's Mosaic GPU backend, for Hopper (issue 66).

``y[M, N] = x[M, K] @ W[K, N]``, W held as int8 values and float32 scales, the contract
of pallas_kernels.quantized_matmul (per column: ``group=0``, jaxllm's int8; per
``group`` inputs of a column, with optional mins: GGUF's Q8_0 / Q4_0 / Q4_1, grouped
int4 and int8), with the values stored transposed, ``q_t[N, K]`` (K-major: a weight
row's inputs contiguous, as each step's tile is read). Design (docs/kernels.md):

* **Swapped operands.** The kernel computes ``y^T = W^T x^T``: 64 output columns are
  one warpgroup's wgmma M, and the tokens (``M``, 1-64 in a decode step) its N, padded
  to a multiple of 16, so a decode step multiplies no padding rows of the weights.
* **Grid** ``(N / 64, cdiv(M, block_m), split_k)``; a block walks its share of K in
  steps of ``block_k`` (the group when grouped, else 64): TMA copies of the value tile
  ``[64, block_k]`` (int8) and of x's ``[block_m, block_k]`` into a ring of ``stages``
  shared-memory slots, one barrier per slot; the values converted in registers to
  float32, scaled per output row (grouped: the step's group, and the min added), rounded
  to x's dtype into shared memory, then ``acc += W^T x^T`` by wgmma. Per column, the
  scale multiplies the finished float32 accumulator instead.
* **Split-K** (``split_k`` > 1): each block stores float32 partial sums
  ``[split_k, N, M]``, XLA adds them (the long-K down projection gets more blocks than
  its 64-column tiles alone).

Supported: x bfloat16 or float16; N a multiple of 64; K a multiple of ``block_k``;
group 0 or a multiple of 16 up to 256. ``unsupported`` says why not otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.ragged_paged_attention_mgpu import smem_transforms

__all__ = ["quantized_matmul_mgpu", "unsupported", "COLS"]

COLS = 64  # output columns per block: one warpgroup's wgmma M
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def step_size(group: int, bits: int = 8) -> int:
    """Inputs per K step: 64 per column; else the group, or as many groups as make a
    value tile's row 32 bytes (the narrowest swizzle: int4 in groups of 32 takes two)."""
    if not group:
        return 64
    return group * max(1, -(-256 // (group * bits)))


def unsupported(dtype, *, n: int, k: int, group: int, block_k: int | None = None, bits: int = 8) -> str | None:
    """Why this kernel cannot multiply such a weight (None: it can)."""
    block_k = block_k or step_size(group, bits)
    if jnp.dtype(dtype) not in DTYPES:
        return f"activations of {jnp.dtype(dtype).name} (bfloat16 or float16 only)"
    if n % COLS:
        return f"{n} output columns (a multiple of {COLS} only)"
    if group and (group % 16 or group > 256 or block_k % group):
        return f"groups of {group} (a multiple of 16 up to 256, whole ones a step)"
    if block_k % 16 or k % block_k:
        return f"K={k} in steps of {block_k}"
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    block_m: int
    block_k: int
    groups: int  # groups per step (grouped formats)
    steps: int  # K steps per block (its share of K under split-K)
    stages: int
    group: int
    has_mins: bool
    split: bool  # partial sums out


def _kernel(x_ref, q_ref, s_ref, *refs, st: _Static):
    if st.has_mins:
        mins_ref, o_ref, q_smem, x_smem, w_smem, out_smem, s_smem, bars, col_bar = refs
    else:
        mins_ref, (o_ref, q_smem, x_smem, w_smem, out_smem, s_smem, bars, col_bar) = None, refs
    n0 = lax.axis_index("n") * COLS
    m0 = lax.axis_index("m") * st.block_m
    first = lax.axis_index("s") * st.steps
    cols = pl.ds(n0, COLS)
    row_vector = plgpu.Layout.WGMMA.reduce(1)  # one value per output row (column of W)

    def fetch(step, slot):
        ks = pl.ds((first + step) * st.block_k, st.block_k)
        plgpu.copy_gmem_to_smem(q_ref.at[cols, ks], q_smem.at[slot], bars.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(m0, st.block_m), ks], x_smem.at[slot], bars.at[slot])
        for g in range(st.groups if st.group else 0):  # the step's groups' scales (and mins), via shared memory
            row = (first + step) * st.groups + g
            plgpu.copy_gmem_to_smem(s_ref.at[row, cols], s_smem.at[slot, g], bars.at[slot])
            if st.has_mins:
                plgpu.copy_gmem_to_smem(mins_ref.at[row, cols], s_smem.at[slot, st.groups + g], bars.at[slot])

    if not st.group:  # the columns' scales: one copy, waited for at the end
        plgpu.copy_gmem_to_smem(s_ref.at[cols], s_smem.at[0, 0], col_bar.at[0])
    for s in range(min(st.stages, st.steps)):
        fetch(s, s)

    def step(i, acc):
        slot = lax.rem(i, st.stages)
        plgpu.barrier_wait(bars.at[slot])
        if q_smem.dtype == jnp.int4:  # two values a byte: widened in two steps
            w = plgpu.load(q_smem.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_4X)
            w = plgpu.layout_cast(w, plgpu.Layout.WGMMA_UPCAST_2X).astype(w_smem.dtype)
        else:
            w = plgpu.load(q_smem.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(w_smem.dtype)
        w = plgpu.layout_cast(w, plgpu.Layout.WGMMA)  # exact in 16 bits, each row a column of W
        if st.group:  # each group's scale (and min) per row, in float32, rounded once
            w = w.astype(jnp.float32) * _per_group(s_smem.at[slot], 0, st)
            if st.has_mins:
                w = w + _per_group(s_smem.at[slot], st.groups, st)
        w_smem[...] = w.astype(w_smem.dtype)
        plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, w_smem, x_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        acc = acc + pl.run_scoped(product, plgpu.ACC((COLS, st.block_m), jnp.float32))
        pl.when(i + st.stages < st.steps)(lambda: fetch(i + st.stages, slot))
        return acc

    acc = plgpu.layout_cast(jnp.zeros((COLS, st.block_m), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, st.steps, step, acc)
    if not st.group:
        plgpu.barrier_wait(col_bar.at[0])
        acc = acc * lax.broadcast_in_dim(plgpu.load(s_smem.at[0, 0], layout=row_vector), acc.shape, [0])
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    out = o_ref.at[lax.axis_index("s")] if st.split else o_ref
    plgpu.copy_smem_to_gmem(out_smem, out.at[cols, pl.ds(m0, st.block_m)])
    plgpu.wait_smem_to_gmem(0)


def _per_group(rows_ref, first: int, st: _Static) -> jax.Array:
    """[64, block_k] of the step's groups' per-row values (rows `first` + g of
    `rows_ref`), each over its group's columns."""
    shape = (COLS, st.block_k)
    row = lambda g: lax.broadcast_in_dim(plgpu.load(rows_ref.at[first + g], layout=plgpu.Layout.WGMMA.reduce(1)),
                                         shape, [0])
    out = row(0)
    if st.groups > 1:
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        for g in range(1, st.groups):
            out = jnp.where(cols >= g * st.group, row(g), out)
    return out


def default_block_m(m: int) -> int:
    """Tokens per block: M rounded up to 16, at most 128."""
    return min(128, -(-m // 16) * 16)


@functools.partial(jax.jit, static_argnames=("group", "block_m", "split_k", "stages", "out_dtype", "interpret"))
def quantized_matmul_mgpu(
    x: Float[Array, "M K"], q_t: Int[Array, "N K"], scale: Float[Array, " N"] | Float[Array, "G N"],
    mins: Float[Array, "G N"] | None = None, *, group: int = 0, block_m: int | None = None, split_k: int = 1,
    stages: int = 3, out_dtype=None, interpret: bool | plgpu.InterpretGPUParams = False,
) -> Float[Array, "M N"]:
    """``x @ W`` for ``W`` as int8 values held transposed, ``q_t`` [N, K], with float32
    scales per column (``group=0``: ``scale`` [N]) or per ``group`` inputs of a column
    (``scale``, and ``mins`` for Q4_1, [K / group, N]); float32 sums, `out_dtype`
    (default x's) out. `interpret`: True or an InterpretGPUParams runs Mosaic GPU's
    interpreter."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    (m, k), n = x.shape, q_t.shape[0]
    bits = 4 if q_t.dtype == jnp.int4 else 8
    block_k = step_size(group, bits)
    if q_t.shape != (n, k) or q_t.dtype not in (jnp.int8, jnp.int4):
        raise ValueError(f"quantized_matmul_mgpu: q_t must be int8 or int4 [N, K={k}], got {q_t.dtype} {q_t.shape}")
    why = unsupported(x.dtype, n=n, k=k, group=group, bits=bits)
    if why is not None:
        raise ValueError(f"quantized_matmul_mgpu: not for {why}")
    expected = (k // group, n) if group else (n,)
    if scale.shape != expected or (mins is not None and mins.shape != expected) or (mins is not None and not group):
        raise ValueError(f"quantized_matmul_mgpu: scales (and mins, grouped only) must be {expected}, got "
                         f"{scale.shape}" + ("" if mins is None else f" and {mins.shape}"))
    steps = k // block_k
    if split_k < 1 or steps % split_k:
        raise ValueError(f"quantized_matmul_mgpu: split_k={split_k} must divide the {steps} steps of {block_k} over K")
    block_m = block_m or default_block_m(m)
    m_pad = -(-m // block_m) * block_m
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    st = _Static(block_m, block_k, block_k // group if group else 1, steps // split_k, stages, group, mins is not None,
                 split_k > 1)
    part = jnp.float32 if split_k > 1 else out_dtype
    out_shape = (split_k, n, m_pad) if split_k > 1 else (n, m_pad)
    args = [jnp.pad(x, ((0, m_pad - m), (0, 0))), q_t, scale.astype(jnp.float32)]
    if mins is not None:
        args.append(mins.astype(jnp.float32))
    y_t = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=jax.ShapeDtypeStruct(out_shape, part),
        grid=(n // COLS, m_pad // block_m, split_k),
        grid_names=("n", "m", "s"),
        scratch_types=[
            plgpu.SMEM((stages, COLS, block_k), q_t.dtype, transforms=smem_transforms(q_t.dtype, block_k)),
            plgpu.SMEM((stages, block_m, block_k), x.dtype, transforms=smem_transforms(x.dtype, block_k)),
            plgpu.SMEM((COLS, block_k), x.dtype, transforms=smem_transforms(x.dtype, block_k)),
            plgpu.SMEM((COLS, block_m), part, transforms=smem_transforms(part, block_m)),
            plgpu.SMEM((stages, 2 * st.groups, COLS), jnp.float32),  # a step's scales, then mins (per column: [0, 0])
            # per slot: the value tile, the x tile, the scales, the mins; and the columns' scales
            plgpu.Barrier(num_arrivals=2 + (st.groups * (1 + (mins is not None)) if group else 0), num_barriers=stages),
            plgpu.Barrier(num_barriers=1),
        ],
        interpret=interpret,
        kernel_name=f"quantized_matmul_mgpu_g{group}_bm{block_m}" + (f"_sk{split_k}" if split_k > 1 else ""),
    )(*args)
    if split_k > 1:
        y_t = y_t.sum(axis=0)
    return y_t[:, :m].T.astype(out_dtype)
