"""LoRA adapters served beside their base model (vLLM's `--enable-lora`): the request
naming an adapter (`LoRARequest`), the engine's limits (`LoRAConfig`), and PEFT's
adapter format read into host arrays (`jaxllm.lora.peft`). The batched product of the
step is jaxllm.models.lora's; the device slots, jaxllm.worker.lora_manager's."""

from jaxllm.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
