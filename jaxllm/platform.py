"""What the JAX platform is and what follows from it: the default compute dtype and
where compiled executables are kept."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DEFAULT_COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxllm" / "xla"


def backend() -> str:
    return jax.default_backend()


def resolve_dtype(dtype: str | None) -> jnp.dtype:
    """'auto' -> float32 on CPU (XLA:CPU is fastest there) and bfloat16 on accelerators."""
    if dtype in (None, "auto"):
        return jnp.dtype(jnp.float32 if backend() == "cpu" else jnp.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unsupported {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return jnp.dtype(DTYPES[dtype])


def compilation_cache_path(cache_dir: str | Path | None = None) -> Path:
    """The directory (created) an engine keeps its compiled step executables and
    converted models in: `cache_dir`, default ~/.cache/jaxllm/xla; the engine passes it
    down (jaxllm.worker.executable_cache), so a restart loads them instead of compiling,
    and two engines in one process keep to their own.

    JAX's own persistent compilation cache is left alone (off unless the user turns it
    on): it is keyed by the lowered program, so a restart would still trace and lower
    every bucket, and an executable it returns cannot be serialized again (jaxlib
    0.10 loses its kernels; the store refuses such executables)."""
    path = Path(cache_dir) if cache_dir else DEFAULT_COMPILATION_CACHE
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def host_cpu() -> str:
    """The host CPU's model and feature flags (XLA:CPU and the C++ kernels compile for
    the host, so what they build is only reused on the same kind of CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in lines:
        if ":" in line:
            key, value = (s.strip() for s in line.split(":", 1))
            fields.setdefault(key, value)
    return f"{fields.get('model name', '')}|{fields.get('flags', fields.get('Features', ''))}"
