"""Scatter the new tokens' K/V into the paged KV cache (Pallas, Triton lowering).

Why a separate kernel rather than writing K/V from inside the attention kernel: a
prefill chunk is split over several query-tile programs, and the tile for tokens
64..127 must see the K/V of tokens 0..63, which another program of the *same* launch
would be writing. A launch has no grid-wide barrier, so the cache must be complete
before attention starts. The write is a pure bandwidth-bound copy of
``T * Hkv * D`` elements per cache, tiny next to the attention's reads.

The engine does not call it: on every backend, the Pallas one included, the model writes
K/V with XLA's scatter (``jaxllm.attention.kv_cache.write_kv_cache``), which needs no
kernel of its own and lowers everywhere. This kernel is the Triton-lowered alternative,
proven against that scatter in interpret mode and by CUDA lowering (tests), for the day a
GPU measurement shows the scatter losing; then the Pallas path would pass it to the
model as its write function. No GPU measurement has been made yet (docs/kernels.md).

Grid ``(cdiv(T, block_t), num_kv_heads)``: each program copies ``block_t`` tokens of
one KV head to the slots ``slot_mapping`` gives (``block_id * block_size + offset``).
Caches are aliased input -> output, so under ``jit`` with donation the update is in
place. Padding tokens point into the null block; their (possibly repeated) writes are
garbage that is never read.

Cache dtypes: the new K/V are cast to the cache's dtype; for a float8_e4m3fn cache they
are first clipped to +-448 (the format has no inf: writes saturate, as
``jaxllm.attention.kv_cache.quantize_rows`` does). An int8 cache needs per-row scales
computed from each row; that write is ``jaxllm.attention.kv_cache.write_kv_cache``'s
(no Pallas int8 write yet), and this kernel refuses one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.reference import FP8_E4M3_MAX

__all__ = ["write_kv_cache"]


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _to_cache(x, dtype):
    """New K/V elements as the cache stores them: fp8 saturates at +-448."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        x = jnp.clip(x.astype(jnp.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.astype(dtype)


def _write_kernel(slot_ref, k_ref, v_ref, kc_in_ref, vc_in_ref, kc_ref, vc_ref, *,
                  num_tokens: int, num_slots: int, block_t: int, head_dim: int,
                  d_pad: int):
    del kc_in_ref, vc_in_ref  # aliased to kc_ref / vc_ref
    i = pl.program_id(0)
    h = pl.program_id(1)
    t = i * block_t + jnp.arange(block_t, dtype=jnp.int32)
    valid = t < num_tokens
    slot = plgpu.load(slot_ref.at[t], mask=valid, other=0)
    # Rows past T go one past the end: masked on GPU, dropped by the interpreter.
    slot = jnp.where(valid, slot, num_slots)
    d = jnp.arange(d_pad, dtype=jnp.int32)
    mask = valid[:, None]
    if d_pad != head_dim:
        mask = mask & (d < head_dim)[None, :]
    k = plgpu.load(k_ref.at[t[:, None], h, d[None, :]], mask=mask, other=0)
    v = plgpu.load(v_ref.at[t[:, None], h, d[None, :]], mask=mask, other=0)
    plgpu.store(kc_ref.at[slot[:, None], h, d[None, :]], _to_cache(k, kc_ref.dtype), mask=mask)
    plgpu.store(vc_ref.at[slot[:, None], h, d[None, :]], _to_cache(v, vc_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "block_t", "num_warps"))
def write_kv_cache(
    k: Float[Array, "T Hkv hd"],
    v: Float[Array, "T Hkv hd"],
    k_cache: Shaped[Array, "N B Hkv hd"],
    v_cache: Shaped[Array, "N B Hkv hd"],
    slot_mapping: Int[Array, " T"],
    *,
    interpret: bool = False,
    block_t: int = 32,
    num_warps: int = 4,
) -> tuple[Shaped[Array, "N B Hkv hd"], Shaped[Array, "N B Hkv hd"]]:
    """Return the caches with ``cache[slot_mapping[t]] = new[t]`` for every token t.

    Same contract as ``reference.write_kv_cache_reference``. ``block_t`` (tokens per
    program) must be a power of two. A float8_e4m3fn cache gets the values clipped to
    +-448; an int8 cache is refused (its scaled write is
    ``jaxllm.attention.kv_cache.write_kv_cache``'s).
    """
    T, Hkv, D = k.shape
    NB, BS, Hkv_c, D_c = k_cache.shape
    if v.shape != k.shape or v_cache.shape != k_cache.shape:
        raise ValueError("k/v and k_cache/v_cache shapes must match pairwise")
    if (Hkv, D) != (Hkv_c, D_c):
        raise ValueError(f"new K/V heads/dim {(Hkv, D)} != cache {(Hkv_c, D_c)}")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping must be [{T}], got {slot_mapping.shape}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if k_cache.dtype == jnp.int8:
        raise ValueError("write_kv_cache: an int8 KV cache needs per-row scales; its scaled write is "
                         "done by jaxllm.attention.kv_cache.write_kv_cache (no Pallas int8 write yet)")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two")
    num_slots = NB * BS
    kernel = functools.partial(
        _write_kernel, num_tokens=T, num_slots=num_slots, block_t=block_t,
        head_dim=D, d_pad=_next_pow2(D))
    cache_shape = jax.ShapeDtypeStruct((num_slots, Hkv, D), k_cache.dtype)
    kc, vc = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, block_t), Hkv),
        out_shape=(cache_shape, cache_shape),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="write_kv_cache",
    )(
        slot_mapping.astype(jnp.int32), k, v,
        k_cache.reshape(num_slots, Hkv, D), v_cache.reshape(num_slots, Hkv, D),
    )
    return kc.reshape(NB, BS, Hkv, D), vc.reshape(NB, BS, Hkv, D)
