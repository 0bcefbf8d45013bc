"""What the JAX platform is and what follows from it: the default compute dtype and
the persistent compilation cache."""

from __future__ import annotations

import os
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


def enable_compilation_cache(cache_dir: str | Path | None = None) -> Path:
    """Turn on JAX's persistent compilation cache, so a restart skips XLA compiles."""
    path = Path(cache_dir) if cache_dir else DEFAULT_COMPILATION_CACHE
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
