"""Messages only the engine frontend and the engine core process exchange (besides
the shared types of :mod:`jaxllm.messages`): the core's ready report, its refusals,
and adapters loaded and unloaded at run time."""

from __future__ import annotations

import dataclasses

from jaxllm.lora.request import LoRARequest
from jaxllm.pooling_params import PoolerConfig


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
class EngineCoreRejection:
    """An added request the core refused (it failed validation there)."""

    request_id: str
    message: str
