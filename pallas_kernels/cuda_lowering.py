"""Check, without a GPU, that the kernels lower for CUDA for a given configuration.

``jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`` runs the Pallas ->
Triton IR lowering (power-of-two block shapes, supported primitives, pointer
arithmetic) and embeds the Triton module in the StableHLO custom call XLA:GPU compiles.
That is as far as a machine without CUDA can go (PTX generation needs the GPU build of
jaxlib), so the kernel wrappers also validate what the lowering cannot see (e.g. every
``tl.dot`` dimension >= 16) before tracing.

The engine integrator should call :func:`check_cuda_lowering` in CI for every model
configuration and every (num_tokens, max_num_seqs) bucket it compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

__all__ = ["AttentionConfig", "ENGINE_CONFIGS", "attention_specs", "write_specs",
           "lower_attention_for_cuda", "lower_write_kv_cache_for_cuda",
           "check_cuda_lowering", "has_triton_call", "lower_for_cuda", "cuda_mesh", "cuda_target", "CUDA_TARGET"]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The attention-relevant part of a model + cache configuration."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
    dtype: str = "bfloat16"  # q's (activations')
    sliding_window: int | None = None
    soft_cap: float | None = None
    cache_dtype: str | None = None  # the KV cache's (None: `dtype`); int8 comes with scales

    @property
    def kv_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype if self.cache_dtype is None else self.cache_dtype)

    @property
    def scaled(self) -> bool:
        """An int8 cache: float32 scales per (token, KV head) come with it."""
        return self.kv_dtype == jnp.int8

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5


# Shapes the engine serves (attention only). Tiny configs are the generated test
# models' shapes (float32 on CPU, also lowered for CUDA); the rest are the public
# models the engine targets.
ENGINE_CONFIGS: tuple[AttentionConfig, ...] = (
    AttentionConfig("tiny-mha-d16-f32", 4, 4, 16, dtype="float32", num_blocks=64,
                    max_model_len=256),
    AttentionConfig("tiny-gqa-d32-f32", 4, 2, 32, dtype="float32", num_blocks=64,
                    max_model_len=256),
    AttentionConfig("tiny-gqa-d64-bs32", 8, 2, 64, block_size=32, num_blocks=64,
                    max_model_len=256),
    AttentionConfig("llama-3.1-8b", 32, 8, 128),
    AttentionConfig("llama-3.1-8b-bs32-f32", 32, 8, 128, block_size=32, dtype="float32"),
    AttentionConfig("llama-3.2-1b", 32, 8, 64),
    AttentionConfig("qwen2.5-0.5b", 14, 2, 64),  # G = 7
    AttentionConfig("qwen2.5-7b", 28, 4, 128),  # G = 7
    AttentionConfig("mistral-7b-v0.1", 32, 8, 128, sliding_window=4096,
                    max_model_len=8192),
    AttentionConfig("gemma-2-2b", 8, 4, 256, sliding_window=4096, soft_cap=50.0),
    AttentionConfig("phi-3-mini", 32, 32, 96),  # MHA, head_dim 96
)

# (num_tokens, max_num_seqs) buckets: a small decode bucket and a large mixed one.
DEFAULT_BUCKETS: tuple[tuple[int, int], ...] = ((8, 8), (2048, 256))


def attention_specs(cfg: AttentionConfig, num_tokens: int, max_num_seqs: int):
    """The attention kernel's positional arguments (q, caches, kv_lens, block_tables,
    query_start_loc, num_seqs); for an int8 cache followed by k_scale, v_scale (which
    the kernel takes by keyword: see :func:`lower_attention_for_cuda`)."""
    dt = jnp.dtype(cfg.dtype)
    sd = jax.ShapeDtypeStruct
    cache = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    specs = (
        sd((num_tokens, cfg.num_q_heads, cfg.head_dim), dt),
        sd(cache, cfg.kv_dtype),
        sd(cache, cfg.kv_dtype),
        sd((max_num_seqs,), jnp.int32),
        sd((max_num_seqs, cfg.max_blocks_per_seq), jnp.int32),
        sd((max_num_seqs + 1,), jnp.int32),
        sd((1,), jnp.int32),
    )
    if cfg.scaled:
        specs += (sd(cache[:3], jnp.float32), sd(cache[:3], jnp.float32))
    return specs


def write_specs(cfg: AttentionConfig, num_tokens: int):
    """New K/V in the activations' dtype, caches in the cache's."""
    dt = jnp.dtype(cfg.dtype)
    sd = jax.ShapeDtypeStruct
    new = sd((num_tokens, cfg.num_kv_heads, cfg.head_dim), dt)
    cache = sd((cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim), cfg.kv_dtype)
    return new, new, cache, cache, sd((num_tokens,), jnp.int32)


def lower_attention_for_cuda(cfg: AttentionConfig, num_tokens: int, max_num_seqs: int,
                             **kernel_kwargs):
    kw = dict(sm_scale=cfg.sm_scale, sliding_window=cfg.sliding_window,
              soft_cap=cfg.soft_cap, **kernel_kwargs)

    def f(*args):
        if cfg.scaled:
            *args, k_scale, v_scale = args
            return ragged_paged_attention(*args, k_scale=k_scale, v_scale=v_scale, **kw)
        return ragged_paged_attention(*args, **kw)

    return lower_for_cuda(f, *attention_specs(cfg, num_tokens, max_num_seqs))


def lower_write_kv_cache_for_cuda(cfg: AttentionConfig, num_tokens: int):
    return lower_for_cuda(write_kv_cache, *write_specs(cfg, num_tokens))


# The GPU a CPU-only lowering targets: the Triton lowering asks the device's kind for
# its compute capability (jax 0.11+), and on a machine with no GPU an abstract one names it.
CUDA_TARGET = "NVIDIA H100"


def cuda_mesh(num_devices: int = 1, axis_name: str = "cuda", device_kind: str = CUDA_TARGET
              ) -> jax.sharding.AbstractMesh:
    """An abstract mesh of `num_devices` GPUs of `device_kind` over axis `axis_name`."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    return jax.sharding.AbstractMesh((num_devices,), (axis_name,), abstract_device=device)


def cuda_target(device_kind: str = CUDA_TARGET):
    """A context in which lowering for CUDA targets a GPU of `device_kind`: what
    `lower_for_cuda` lowers under (a sharded lowering: `use_abstract_mesh(cuda_mesh(n))`)."""
    return jax.sharding.use_abstract_mesh(cuda_mesh(device_kind=device_kind))


def lower_for_cuda(fn, *specs, device_kind: str = CUDA_TARGET):
    """`fn` traced at `specs` (ShapeDtypeStructs or arrays) and lowered for CUDA on
    any machine: ``jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))``
    with `device_kind` as the target GPU."""
    with cuda_target(device_kind):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


def has_triton_call(stablehlo_text: str) -> bool:
    """Whether a lowered module calls a Triton kernel (old or new jaxlib ABI)."""
    return ("xla.gpu.triton" in stablehlo_text
            or "triton_kernel_call" in stablehlo_text)


def check_cuda_lowering(
    configs: Iterable[AttentionConfig] = ENGINE_CONFIGS,
    buckets: Iterable[tuple[int, int]] = DEFAULT_BUCKETS,
) -> int:
    """Lower both kernels for every config x bucket; raise on the first failure.

    Returns the number of lowerings done. Each lowered module must contain the
    Triton custom call, i.e. the Pallas kernel really went through the GPU path.
    An int8 cache has no Pallas write (jaxllm.attention.kv_cache writes it): only
    its attention is lowered.
    """
    n = 0
    buckets = tuple(buckets)
    for cfg in configs:
        for num_tokens, max_num_seqs in buckets:
            lowerings = [lower_attention_for_cuda(cfg, num_tokens, max_num_seqs)]
            if not cfg.scaled:
                lowerings.append(lower_write_kv_cache_for_cuda(cfg, num_tokens))
            for lowered in lowerings:
                if not has_triton_call(lowered.as_text()):
                    raise AssertionError(f"{cfg.name}: no Triton kernel in the lowering")
                n += 1
    return n
