"""Messages only the engine frontend and the engine core process exchange (besides
the shared types of :mod:`jaxllm.messages`): the core's ready report, its refusals,
adapters loaded and unloaded at run time, and the utilities the development
endpoints run (sleep, wake_up, weights from a path, pause and resume)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxllm.lora.request import LoRARequest
from jaxllm.multimodal.image_processor import ImageProcessorConfig
from jaxllm.pooling_params import PoolerConfig
from jaxllm.vision_config import VisionConfig


class EngineCoreStartError(RuntimeError):
    """The engine core process failed to start: its message (bad input), or its traceback."""


@dataclasses.dataclass
class EngineCoreReady:
    """Sent once by the core process when the model is loaded and compiled."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    tokenizer_dir: str  # the tokenizer, saved by the core for the frontend to load
    num_blocks: int
    block_size: int
    load_seconds: float
    warmup_seconds: float
    runner: str = "generate"  # or "pooling" (embeddings)
    pooler: PoolerConfig | None = None  # the pooling runner's
    hidden_size: int = 0
    # a vision-language model's image side and image processor, and the images a prompt may hold
    vision: VisionConfig | None = None
    image_processor: ImageProcessorConfig | None = None
    images_per_prompt: int = 0


@dataclasses.dataclass
class LoRAUpdate:
    """Frontend -> core: read and check adapter `add`, or forget adapter id `remove`."""

    op_id: int
    add: LoRARequest | None = None
    remove: int | None = None


@dataclasses.dataclass
class LoRAUpdateResult:
    """Core -> frontend: how LoRAUpdate `op_id` went (`error`: why it failed)."""

    op_id: int
    error: str | None = None


@dataclasses.dataclass
class UtilityCall:
    """Frontend -> core: run the engine core's `method` (one of CORE_UTILITIES) with `args`."""

    op_id: int
    method: str
    args: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class UtilityResult:
    """Core -> frontend: UtilityCall `op_id`'s value, or why it failed (`busy`: requests
    were in flight)."""

    op_id: int
    value: bool | None = None
    error: str | None = None
    busy: bool = False


# what a frontend may run in the core (the server's development endpoints); one that
# returns EngineCoreOutputs (pause: the requests it ended) has them sent as outputs first
CORE_UTILITIES = ("sleep", "wake_up", "is_sleeping", "reset_prefix_cache", "update_weights_from_path",
                  "pause", "resume", "is_paused", "is_drained")


@dataclasses.dataclass
class EngineCoreRejection:
    """An added request the core refused (it failed validation there)."""

    request_id: str
    message: str
