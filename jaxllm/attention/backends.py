"""Attention backends, chosen by name. All share the signature of
pallas_kernels.ragged_paged_attention:

    fn(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
       *, sm_scale, sliding_window=None, soft_cap=None) -> [T, H, hd]
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxllm.attention.xla import ragged_paged_attention_xla

BACKENDS = ("auto", "xla", "pallas")


def resolve_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return name


def get_attention_fn(name: str) -> Callable:
    """The attention function for a backend name ('auto' resolved for this platform).
    Off GPU the Pallas kernels run in interpret mode (for tests: slow but exact)."""
    name = resolve_backend_name(name)
    if name == "xla":
        return ragged_paged_attention_xla
    import pallas_kernels

    return functools.partial(pallas_kernels.ragged_paged_attention, interpret=jax.default_backend() != "gpu")
