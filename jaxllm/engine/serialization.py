"""The wire format between the frontend and the engine core process: one msgpack
array [kind, payload] per message, payloads being the dataclasses of
messages.py and engine/protocol.py (msgspec encodes and checks them)."""

from __future__ import annotations

from typing import Any

import msgspec

from jaxllm.engine.protocol import (
    EngineCoreReady,
    EngineCoreRejection,
    LoRAUpdate,
    LoRAUpdateResult,
    UtilityCall,
    UtilityResult,
)
from jaxllm.messages import EngineCoreOutputs, EngineCoreRequest

# frontend -> core
ADD, ABORT, SHUTDOWN, LORA, UTILITY = "add", "abort", "shutdown", "lora", "utility"
# core -> frontend
READY, OUTPUTS, REJECTED, FATAL, LORA_RESULT = "ready", "outputs", "rejected", "fatal", "lora_result"
UTILITY_RESULT = "utility_result"

PAYLOAD_TYPES: dict[str, Any] = {
    ADD: list[EngineCoreRequest],
    ABORT: list[str],
    SHUTDOWN: None,
    LORA: LoRAUpdate,
    LORA_RESULT: LoRAUpdateResult,
    UTILITY: UtilityCall,
    UTILITY_RESULT: UtilityResult,
    READY: EngineCoreReady,
    OUTPUTS: EngineCoreOutputs,
    REJECTED: EngineCoreRejection,
    FATAL: str,
}

_encoder = msgspec.msgpack.Encoder()


def encode(kind: str, payload: Any = None) -> bytes:
    return _encoder.encode((kind, payload))


def decode(data: bytes) -> tuple[str, Any]:
    kind, payload = msgspec.msgpack.decode(data)
    payload_type = PAYLOAD_TYPES[kind]
    return kind, None if payload_type is None else msgspec.convert(payload, payload_type)
