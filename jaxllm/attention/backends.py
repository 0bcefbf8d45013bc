"""Attention backends, chosen by name. All share the signature of
pallas_kernels.ragged_paged_attention:

    fn(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
       *, sm_scale, sliding_window=None, soft_cap=None) -> [T, H, hd]

- `xla`: pure jnp, every platform; the oracle of the others.
- `cpu`: the C++ custom call of jaxllm.attention.cpu (XLA:CPU only; float32; the kernel
  is in jaxllm/cpu_kernels/).
- `pallas`: the Pallas GPU kernels (interpret mode off GPU: for tests, slow but exact).
- `auto`: pallas on GPU; on CPU the cpu backend when the model can use it and its
  kernels build here, else xla (the reason logged).
"""

from __future__ import annotations

import logging
from typing import Callable

import jax

from jaxllm.attention.xla import ragged_paged_attention_xla

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xla", "cpu", "pallas")


def resolve_backend_name(name: str, *, head_dim: int, dtype) -> str:
    """The backend `name` means for a model of this head_dim and compute dtype on this
    platform; an explicit choice that cannot work raises ValueError saying why."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; choose one of {', '.join(BACKENDS)}")
    platform = jax.default_backend()
    if name == "auto":
        if platform == "gpu":
            return "pallas"
        if platform != "cpu":
            return "xla"
        reason = _cpu_backend_unavailable(head_dim, dtype)
        if reason:
            logger.warning("attention_backend auto: using xla, not cpu: %s", reason)
            return "xla"
        return "cpu"
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_backend: 'cpu' runs on the CPU platform only (this is {platform})")
        reason = _cpu_backend_unavailable(head_dim, dtype)
        if reason:
            raise ValueError(f"attention_backend 'cpu': {reason}")
    return name


def _cpu_backend_unavailable(head_dim: int, dtype) -> str | None:
    from jaxllm.attention import cpu

    reason = cpu.unsupported(head_dim, dtype)
    if reason:
        return reason
    try:
        cpu.load_kernels()
    except cpu.KernelBuildError as e:
        return str(e)
    return None


def _pallas_attention(*args, common_prefix_blocks=None, **kwargs):
    """The Pallas kernels (interpret mode off GPU); they do not use the common-prefix hint."""
    import pallas_kernels

    del common_prefix_blocks
    return pallas_kernels.ragged_paged_attention(*args, interpret=jax.default_backend() != "gpu", **kwargs)


def get_attention_fn(name: str) -> Callable:
    """The attention function of a resolved backend name (see resolve_backend_name)."""
    if name == "xla":
        return ragged_paged_attention_xla
    if name == "cpu":
        from jaxllm.attention.cpu import ragged_paged_attention_cpu

        return ragged_paged_attention_cpu
    if name == "pallas":
        return _pallas_attention
    raise ValueError(f"attention_backend: {name!r} is not a resolved backend name")
