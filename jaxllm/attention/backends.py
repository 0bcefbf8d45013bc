"""Attention backends, chosen by name. All share the signature of
pallas_kernels.ragged_paged_attention:

    fn(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
       *, sm_scale, sliding_window=None, soft_cap=None, common_prefix_blocks=None,
       k_scale=None, v_scale=None, cache_dtype="") -> [T, H, hd]

(`AttentionFn` below writes the contract down once.)

- `xla`: pure jnp, every platform; the oracle of the others.
- `cpu`: the C++ custom call of jaxllm.attention.cpu (XLA:CPU only; float32
  activations, a cache of any KV cache format; the kernel is in jaxllm/cpu_kernels/).
- `pallas`: the Pallas kernel on its Triton backend, every CUDA GPU (interpret mode off
  GPU: for tests, slow but exact).
- `mosaic`: the Pallas kernel on Mosaic GPU (pallas_kernels.ragged_paged_attention_mgpu),
  Hopper GPUs only, bfloat16 / float16 queries over a cache of their dtype (Mosaic GPU's
  interpreter off GPU).
- `auto`: on a GPU pallas, and on a Hopper the faster of pallas and mosaic per step
  shape where mosaic serves the model (on an H200 the Triton kernel was the faster in
  every workload of the kernel benchmark: docs/kernels.md); on CPU the faster of cpu and
  xla; measured at start-up (jaxllm.worker.autotune), a tie going to the first; xla
  alone when the model cannot use the cpu backend or its kernels do not build here
  (the reason logged).
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol, runtime_checkable

import jax
from jaxtyping import Array, Float, Int, Shaped

from jaxllm.attention.kv_cache import as_elements
from jaxllm.attention.xla import ragged_paged_attention_xla
from jaxllm.config import ATTENTION_BACKENDS
from jaxllm.platform import backend_candidates, targets_gpu, targets_hopper

logger = logging.getLogger(__name__)

# `auto` on a GPU is the Pallas kernels. On an H100 (2026-11-25) the engine gave other
# greedy tokens with pallas than with xla on one request, and `auto` was xla for a while;
# on an H200 (2026-11-27) that workload's every attention call, replayed, gave the same
# bits inside the step as alone, within bfloat16 rounding of the float32 reference, and
# in float32 the engine's tokens were xla's: the bfloat16 default rounds the two
# backends' sums apart, no kernel fault (docs/kernels.md, "The H100's differing tokens").


@runtime_checkable
class AttentionFn(Protocol):
    """The contract every attention backend keeps (the signature of
    pallas_kernels.ragged_paged_attention, plus the engine's hints).

    Args:
        q: the step's queries, T tokens of the ragged batch.
        k_cache, v_cache: one layer's paged cache, in one of the KV cache formats
            (jaxllm.attention.kv_cache: float32, bfloat16, float16, float8_e4m3fn, int8).
        kv_lens: tokens of each sequence whose K/V the cache holds after this step's
            writes (context + new).
        block_tables: each sequence's blocks.
        query_start_loc: sequence i's queries are q[query_start_loc[i]:query_start_loc[i + 1]].
        num_seqs: real sequences (the rest is padding).
        sm_scale: the softmax scale.
        sliding_window: attend to at most this many latest positions (None: all).
        soft_cap: tanh soft-capping of the scores (None: none).
        common_prefix_blocks: leading blocks all sequences share; a hint a backend may
            use to read them once (the cpu backend does), never needed for correctness.
        k_scale, v_scale: an int8 cache's scale per token and KV head (None otherwise):
            a row reads as its elements times its scale.
        cache_dtype: the element type's name where the caches hold its bits as unsigned
            integers (KVCache.dtype: 16- and 8-bit floats on the CPU); "": their dtype.

    Returns:
        The attention output, [T, H, hd] (rows of padding tokens are unspecified).
    """

    def __call__(
        self,
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
    ) -> Float[Array, "T H hd"]: ...


def attention_candidates(name: str, *, head_dim: int, dtype, cache_dtype=None, heads: tuple[int, int] = (1, 1),
                         block_size: int = 16) -> list[str]:
    """The backends `name` may mean for a model of this head_dim, (query, KV) `heads`
    and compute dtype, with a KV cache of `cache_dtype` (default: `dtype`) in blocks of
    `block_size`, on this platform, in preference order (`auto` on a CPU: cpu and xla,
    measured by the runner); an explicit choice that cannot work raises ValueError
    saying why."""
    platform = jax.default_backend()
    gpu = ["pallas", "mosaic"] if targets_hopper() else ["pallas"]
    preference = {"gpu": gpu, "cpu": ["cpu", "xla"]}.get(platform, ["xla"])
    cache_dtype = dtype if cache_dtype is None else cache_dtype

    def unavailable(backend: str) -> str | None:
        if backend == "cpu":
            if platform != "cpu":
                return f"it runs on the CPU platform only (this is {platform})"
            return _cpu_backend_unavailable(head_dim, dtype, cache_dtype)
        if backend == "mosaic":
            from pallas_kernels.ragged_paged_attention_mgpu import unsupported

            if not targets_hopper():
                return "Mosaic GPU's kernel runs on Hopper GPUs only (compute capability 9.x)"
            return unsupported(dtype, cache_dtype, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                               block_size=block_size)
        return None

    return backend_candidates("attention_backend", name, ATTENTION_BACKENDS, preference, unavailable, logger)


def _cpu_backend_unavailable(head_dim: int, dtype, cache_dtype) -> str | None:
    from jaxllm.attention import cpu

    reason = cpu.unsupported(head_dim, dtype, cache_dtype)
    if reason:
        return reason
    try:
        cpu.load_kernels()
    except cpu.KernelBuildError as e:
        return str(e)
    return None


def _pallas_attention(q, k_cache, v_cache, *args, common_prefix_blocks=None, cache_dtype="", **kwargs):
    """The Triton kernel (interpret mode where no GPU is the target). It does not use
    the common-prefix hint, and reads caches of their element type (a cache of bits, on
    the CPU, is viewed as it: a copy, in interpret mode only)."""
    import pallas_kernels

    del common_prefix_blocks
    k_cache, v_cache = as_elements(k_cache, cache_dtype), as_elements(v_cache, cache_dtype)
    return pallas_kernels.ragged_paged_attention(q, k_cache, v_cache, *args, interpret=not targets_gpu(), **kwargs)


def _mosaic_attention(q, k_cache, v_cache, *args, common_prefix_blocks=None, cache_dtype="", k_scale=None,
                      v_scale=None, **kwargs):
    """The Mosaic GPU kernel (its interpreter where no GPU is the target), for the
    configurations attention_candidates let through (no int8 cache: no scales)."""
    from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

    del common_prefix_blocks
    assert k_scale is None and v_scale is None, "mosaic attention: an int8 cache is not served"
    k_cache, v_cache = as_elements(k_cache, cache_dtype), as_elements(v_cache, cache_dtype)
    return ragged_paged_attention_mgpu(q, k_cache, v_cache, *args, interpret=not targets_gpu(), **kwargs)


def get_attention_fn(name: str, batch_invariant: bool = False, bf16_products: bool = False) -> AttentionFn:
    """The attention function of a backend name (one of attention_candidates');
    `batch_invariant`: the cpu kernel's mode where a row's output never depends on the
    others (no other backend has one); `bf16_products`: a bfloat16 model's, whose
    queries the cpu kernel may multiply as bfloat16 (ragged_paged_attention_cpu; the
    other backends multiply them as they are)."""
    if batch_invariant and name != "cpu":
        raise ValueError(f"attention_backend: {name!r} is not batch-invariant (only cpu is)")
    if name == "xla":
        return ragged_paged_attention_xla
    if name == "cpu":
        from jaxllm.attention.cpu import ragged_paged_attention_cpu

        return functools.partial(ragged_paged_attention_cpu, batch_invariant=batch_invariant,
                                 bf16_products=bf16_products)
    if name == "pallas":
        return _pallas_attention
    if name == "mosaic":
        return _mosaic_attention
    raise ValueError(f"attention_backend: {name!r} is not a resolved backend name")
