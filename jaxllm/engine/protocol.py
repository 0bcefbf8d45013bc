"""Messages only the engine frontend and the engine core process exchange (besides
the shared types of :mod:`jaxllm.messages`): the core's ready report and its refusals."""

from __future__ import annotations

import dataclasses


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


@dataclasses.dataclass
class EngineCoreRejection:
    """An added request the core refused (it failed validation there)."""

    request_id: str
    message: str
