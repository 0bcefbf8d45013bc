"""Options given as vLLM's JSON objects (`--speculative-config '{...}'`, `--pooler-config
'{...}'`): the object read and its fields checked in one place, so every such option
refuses bad input in the same words. Plain Python."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def json_object(value: str | Mapping[str, Any], option: str, known: Iterable[str]) -> Mapping[str, Any]:
    """`value` (a mapping, or its JSON) as a mapping whose fields are all `known`;
    ValueError naming `option` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option}: not JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{option}: expected an object, got {type(value).__name__}")
    known = sorted(known)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{option}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return value
