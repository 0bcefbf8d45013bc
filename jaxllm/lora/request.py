"""Plain data: which adapter a request runs under, and the engine's LoRA limits. It
imports nothing of jaxllm, so `jaxllm.messages` (the bottom module) can carry it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter, as vLLM names one: `lora_name` (what the server's clients put in
    `model`), `lora_int_id` (> 0, unique per adapter: it keys the device slots and
    keeps the prefix cache of two adapters apart) and `lora_path` (a PEFT folder:
    adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request: lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request: lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The engine's adapter limits: `max_loras` adapters in device slots at once (a
    step never mixes more), each of rank at most `max_lora_rank`, and up to
    `max_cpu_loras` read adapters kept on the host (least recently used dropped)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
