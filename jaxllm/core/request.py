"""The request record shared by the scheduler and the KV cache manager.

Only what the KV cache manager needs lives here; the scheduler extends it with
sampling parameters and status.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxllm.core.kv_cache_utils import BlockHash


@dataclass(eq=False)
class Request:
    """One generation request as the engine core tracks it.

    Attributes:
        request_id: unique id of the request.
        prompt_token_ids: the prompt's token ids (never changes).
        output_token_ids: generated token ids so far, append-only.
        num_computed_tokens: tokens of ``all_token_ids`` whose KV is in the cache
            (the scheduler advances it; it resets it to 0 on preemption).
        num_cached_tokens: prompt tokens served from the prefix cache when the
            request was first scheduled; -1 until then.
        cache_salt: isolates the request's prefix-cache entries from requests with a
            different (or no) salt.
        lora_id: LoRA adapter id; blocks computed under different adapters never match.
        block_hashes: chained hashes of the request's leading full blocks (see
            :mod:`jaxllm.core.kv_cache_utils`). The KV cache manager fills it lazily,
            only when prefix caching is on, and only as far as it needs; since tokens
            are append-only an entry, once computed, stays valid. Nobody else writes it.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    cache_salt: str | None = None
    lora_id: int | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output token ids (a new list on every call)."""
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append one sampled token id or several."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
