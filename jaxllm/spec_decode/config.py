"""SpeculativeConfig: what `speculative_config` asks for, in vLLM's form and names,
validated in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxllm.json_options import json_object

SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Attributes:
        method: "ngram" (prompt lookup over the request's own tokens) or
            "draft_model" (a smaller model with the target's vocabulary proposes).
        num_speculative_tokens: draft tokens proposed per step (k; a speculating
            decode row is a query of k + 1 tokens).
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths matched (ngram);
            vLLM's defaults: both 5 when neither is given, else the given one for both.
        model: the draft model's path or name (draft_model).
        disable_by_batch_size: speculate only while fewer requests run (None: always).
        short_match_tokens: ngram, a jaxllm extension: a match shorter than
            prompt_lookup_max tokens proposes at most this many (None: every match
            proposes num_speculative_tokens, as vLLM's). A short match's continuation is
            accepted far less often (SmolLM2 editing a given text: the first draft token
            of a 1-2 token match 34-36% of the time, of a 5-token match 95%), and every
            draft token makes the verifying step bigger (1 keeps it at 2 tokens, a
            bucket speculating engines compile).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    short_match_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            _positive("prompt_lookup_min", lo)
            _positive("prompt_lookup_max", hi)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model (use method 'draft_model')")
        elif not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs `model`, the draft's path or name")
        if self.short_match_tokens is not None:
            if self.method != "ngram":
                raise ValueError("speculative_config: short_match_tokens applies to method 'ngram' only")
            _positive("short_match_tokens", self.short_match_tokens)
            if self.short_match_tokens > self.num_speculative_tokens:
                raise ValueError(f"speculative_config: short_match_tokens ({self.short_match_tokens}) exceeds "
                                 f"num_speculative_tokens ({self.num_speculative_tokens})")
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON (the `--speculative-config '{...}'` form); None stays
        None. Unknown fields are named."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config", (f.name for f in dataclasses.fields(cls)))
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: `method` and `num_speculative_tokens` are required")
        return cls(**value)


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
