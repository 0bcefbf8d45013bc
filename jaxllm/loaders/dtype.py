"""`dtype="auto"`: what a checkpoint is computed in here, as vLLM's auto does (the
checkpoint's own dtype where the hardware multiplies it natively).

On an accelerator, bfloat16. On a CPU, a bfloat16 or float16 checkpoint is held and
multiplied in bfloat16 where jaxllm's kernels multiply bfloat16 natively (`vdpbf16ps`:
built with AVX512_BF16), and in float32 elsewhere (a bfloat16 dot without it is slower than
float32's); a float32 checkpoint and a GGUF file (its kept blocks multiply int16 activations
with float32 sums) in float32. What the choice costs and buys on each machine:
docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxllm import cpu_kernels
from jaxllm.config import DTYPE_NAMES

HALF_DTYPES = ("bfloat16", "float16")


def checkpoint_dtype(path: Path) -> str:
    """The dtype an HF (or converted) folder's config.json names (transformers 5's `dtype`
    or 4's `torch_dtype`; float32 when it names none); "float32" for a GGUF file."""
    config = path / "config.json"
    if not config.is_file():
        return "float32"
    hf = json.loads(config.read_text())
    return str(hf.get("dtype") or hf.get("torch_dtype") or "float32")


def choose_dtype(dtype: str | None, stored: str) -> tuple[jnp.dtype, str]:
    """The compute dtype for `dtype` (an EngineConfig name) and a checkpoint stored in
    `stored`, and why (for the start-up line)."""
    if dtype not in (None, "auto"):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: unsupported {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
        return jnp.dtype(dtype), "as asked"
    if jax.default_backend() != "cpu":
        return jnp.dtype(jnp.bfloat16), "auto: bfloat16 on an accelerator"
    if stored not in HALF_DTYPES:
        return jnp.dtype(jnp.float32), f"auto: the checkpoint's {stored}"
    if _native_bf16():
        return jnp.dtype(jnp.bfloat16), f"auto: a {stored} checkpoint, and this CPU multiplies bfloat16 natively"
    return jnp.dtype(jnp.float32), (f"auto: a {stored} checkpoint in float32, as this CPU has no native bfloat16 "
                                    "dot products (AVX512_BF16)")


def _native_bf16() -> bool:
    try:
        return cpu_kernels.has_bf16_dot()
    except cpu_kernels.KernelBuildError:  # no kernels here: XLA's dot, fastest in float32
        return False
