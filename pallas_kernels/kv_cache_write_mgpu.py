"""Scatter the new tokens' K/V into the paged KV cache on Mosaic GPU, for Hopper (issue 66).

The contract of pallas_kernels.kv_cache_write (``cache[slot_mapping[t]] = new[t]``, the
caches aliased in and out, so the update is in place under donation: here they enter the
kernel as mutable refs, ``jax.new_ref``), by TMA: a block of
``block_t`` tokens' K and V (``[block_t, Hkv, D]`` each) is copied into shared memory
in one box each, then every token's ``[Hkv, D]`` row is stored to its slot of the cache
viewed as ``[slots, Hkv, D]`` (one box per token and cache). Tokens past T in the last
block are not stored (the inputs are padded to whole blocks before the launch).
Padding tokens point into the null block, as for the other writes.

For caches of the new K/V's own dtype (bfloat16, float16, float32): a copy, no
arithmetic. fp8 and int8 caches are written by XLA (jaxllm.attention.kv_cache), as the
engine writes every cache today: which write is faster on a Hopper, this one or XLA's
scatter, is for scripts/bench_kernels.py to measure (docs/kernels.md), before either is
made the default.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int, Shaped

__all__ = ["write_kv_cache_mgpu"]


def _write_kernel(slot_ref, k_ref, v_ref, kc_ref, vc_ref, k_smem, v_smem, bar, *, num_tokens: int, block_t: int):
    t0 = lax.axis_index("t") * block_t
    plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(t0, block_t)], k_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(t0, block_t)], v_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    for j in range(block_t):
        pl.when(t0 + j < num_tokens)(functools.partial(_store, slot_ref, kc_ref, vc_ref, k_smem, v_smem, t0, j))
    plgpu.wait_smem_to_gmem(0)


def _store(slot_ref, kc_ref, vc_ref, k_smem, v_smem, t0, j):
    """Token t0 + j's K and V rows, each one box, to its slot."""
    slot = slot_ref[t0 + j]
    plgpu.copy_smem_to_gmem(k_smem.at[j], kc_ref.at[slot])
    plgpu.copy_smem_to_gmem(v_smem.at[j], vc_ref.at[slot])


@functools.partial(jax.jit, static_argnames=("interpret", "block_t"))
def write_kv_cache_mgpu(
    k: Float[Array, "T Hkv hd"],
    v: Float[Array, "T Hkv hd"],
    k_cache: Shaped[Array, "N B Hkv hd"],
    v_cache: Shaped[Array, "N B Hkv hd"],
    slot_mapping: Int[Array, " T"],
    *,
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_t: int = 8,
) -> tuple[Shaped[Array, "N B Hkv hd"], Shaped[Array, "N B Hkv hd"]]:
    """The caches with ``cache[slot_mapping[t]] = new[t]`` for every token t (the
    reference: pallas_kernels.reference.write_kv_cache_reference), for caches of the
    new K/V's dtype. `interpret`: True or an InterpretGPUParams runs Mosaic GPU's
    interpreter."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    T, Hkv, D = k.shape
    NB, BS = k_cache.shape[:2]
    if v.shape != k.shape or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (Hkv, D):
        raise ValueError(f"write_kv_cache_mgpu: new K/V {k.shape} {v.shape} and caches {k_cache.shape} "
                         f"{v_cache.shape} do not match")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"write_kv_cache_mgpu: a copy only: new K/V of {k.dtype} into a {k_cache.dtype} cache "
                         "is XLA's write (jaxllm.attention.kv_cache)")
    if slot_mapping.shape != (T,):
        raise ValueError(f"write_kv_cache_mgpu: slot_mapping must be [{T}], got {slot_mapping.shape}")
    pad = -T % block_t
    k, v = (jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (k, v))
    # The caches as mutable refs the kernel stores into: the launch aliases them in and out
    # (in place where the caller donates them), and every block's stores land in one buffer.
    kc, vc = jax.new_ref(k_cache.reshape(NB * BS, Hkv, D)), jax.new_ref(v_cache.reshape(NB * BS, Hkv, D))
    plgpu.kernel(
        functools.partial(_write_kernel, num_tokens=T, block_t=block_t),
        out_type=(),
        grid=((T + pad) // block_t,),
        grid_names=("t",),
        scratch_types=[plgpu.SMEM((block_t, Hkv, D), k.dtype), plgpu.SMEM((block_t, Hkv, D), k.dtype),
                       plgpu.Barrier(num_arrivals=2, num_barriers=1)],
        interpret=interpret,
        kernel_name="write_kv_cache_mgpu",
    )(slot_mapping.astype(jnp.int32), k, v, kc, vc)
    kc, vc = kc[...], vc[...]
    return kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
