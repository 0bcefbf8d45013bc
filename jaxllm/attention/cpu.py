"""The `cpu` attention backend: ragged paged attention as a C++ XLA FFI custom call.

On XLA:CPU the jnp backend (jaxllm.attention.xla) must copy every K/V block it reads
out of the paged cache before its dots (XLA:CPU does not fuse a gather into a dot), so
a decode step reads the cache about three times. The kernel (jaxllm/cpu_kernels/
paged_attention.cc) reads each K/V row once, where it lies, with an online softmax in
float32, on XLA's intra-op threads (what that saves: docs/cpu_kernels.md and
docs/benchmarks.md).

Same signature and semantics as pallas_kernels.ragged_paged_attention and the XLA
backend, which is its oracle in tests. Float32 q; a cache of any KV cache format
(float32, bfloat16, float16, float8_e4m3fn, or int8 with its scales), widened to float32
as it is read; head_dim one of SUPPORTED_HEAD_DIMS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped

from jaxllm.attention.kv_cache import KV_CACHE_FORMATS
from jaxllm.cpu_kernels import KernelBuildError, load_kernels

__all__ = ["KernelBuildError", "SUPPORTED_HEAD_DIMS", "load_kernels", "ragged_paged_attention_cpu", "unsupported"]

TARGET = "jaxllm_ragged_paged_attention"  # registered by load_kernels
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
CACHE_DTYPES = tuple(f.dtype for f in KV_CACHE_FORMATS.values())  # the kernel reads every format


def unsupported(head_dim: int, dtype, cache_dtype=jnp.float32) -> str | None:
    """Why a model cannot use this backend (activations of `dtype`, a KV cache of
    `cache_dtype`), or None if it can."""
    if jnp.dtype(dtype) != jnp.float32:
        return f"the cpu attention backend needs float32 activations (got {jnp.dtype(dtype).name})"
    if jnp.dtype(cache_dtype) not in CACHE_DTYPES:
        return f"the cpu attention backend reads a KV cache of {', '.join(d.name for d in CACHE_DTYPES)} " \
               f"(got {jnp.dtype(cache_dtype).name})"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the cpu attention backend supports head_dim {SUPPORTED_HEAD_DIMS} (got {head_dim})"
    return None


def ragged_paged_attention_cpu(
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
    common_prefix_blocks: Int[Array, ""] | None = None,
    k_scale: Float[Array, "N B Hkv"] | None = None,
    v_scale: Float[Array, "N B Hkv"] | None = None,
    cache_dtype: str = "",
    causal: bool = True,
    batch_invariant: bool = False,
    bf16_products: bool = False,
) -> Float[Array, "T H hd"]:
    """`common_prefix_blocks` (see AttentionMetadata): those first blocks, shared by
    every sequence, are attended once for all query rows (a matrix product per KV head),
    the rest per sequence, merged through the online softmax's state. `k_scale`,
    `v_scale`: an int8 cache's scales (jaxllm.attention.kv_cache); `cache_dtype`: the
    element type whose bits the caches hold ("": their dtype). `causal` False: every
    query sees every key of its sequence (an encoder's attention; no sliding window).
    `batch_invariant`: each row's output the same bits whatever else the call holds (every
    row by the decode path, its keys in the same chunks, no common prefix pass; slower
    for prefill chunks). `bf16_products`: a bfloat16 model's attention, whose queries
    may be rounded to bfloat16: with a bfloat16 cache, on a CPU with AVX512_BF16, the
    prefill path multiplies them so (by vdpbf16ps, or on AMX's tiles as one bfloat16
    part rather than three; float32 sums and softmax)."""
    load_kernels()
    cache_dtype = jnp.dtype(cache_dtype or k_cache.dtype)
    reason = unsupported(q.shape[-1], q.dtype, cache_dtype)
    if reason:
        raise ValueError(reason)
    if (cache_dtype == jnp.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("the cpu attention backend takes scales with an int8 cache, and only then")
    none = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q, k_cache, v_cache, none if k_scale is None else k_scale, none if v_scale is None else v_scale,
        kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32), query_start_loc.astype(jnp.int32),
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        jnp.reshape(jnp.asarray(0 if common_prefix_blocks is None else common_prefix_blocks), (1,)).astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        cache_dtype=cache_dtype.name,
        causal=np.int32(causal),
        invariant=np.int32(batch_invariant),
        bf16_products=np.int32(bf16_products),
    )
