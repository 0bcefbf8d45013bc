"""EngineConfig: every option of the engine, as LLM(...) and `python -m jaxllm.serve`
take them (the CLI flags are these field names with dashes). Plain Python."""

from __future__ import annotations

import dataclasses
import re

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30}
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30  # CPU devices report no memory: 2 GiB, as vLLM's CPU default
DEFAULT_DEVICE_MEMORY_FRACTION = 0.9


def parse_memory(value: str | int | float | None) -> int | float | None:
    """'4GiB', '512MiB', 2e9 (bytes) -> bytes; a number in (0, 1] -> fraction of device memory."""
    if value is None or isinstance(value, (int, float)):
        if value is not None and value <= 0:
            raise ValueError(f"kv_cache_memory: must be positive, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} (examples: 4GiB, 512MiB, 0.8)")
    number = float(m.group(1))
    if not m.group(2) and number <= 1:
        return number
    return int(number * _UNITS[m.group(2).lower()])


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder, GGUF file or converted checkpoint; None = embedded SmolLM2
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on GPU
    max_model_len: int | None = None  # default: the model's context length
    block_size: int = 16
    kv_cache_memory: str | int | float | None = None  # bytes, "4GiB", or a fraction of device memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"  # auto | xla | cpu | pallas
    linear_backend: str = "auto"  # auto | xla | cpu (jaxllm.models.linear)
    chat_template: str | None = None  # a template string or a file holding one
    compilation_cache_dir: str | None = None  # default ~/.cache/jaxllm/xla
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")
        parse_memory(self.kv_cache_memory)
