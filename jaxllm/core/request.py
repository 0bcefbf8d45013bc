"""The request record shared by the scheduler and the KV cache manager."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxllm.core.kv_cache_utils import BlockHash
from jaxllm.core.prompt_scores import PromptScores
from jaxllm.core.structured_output import StructuredOutputRequest
from jaxllm.core.token_filter import TokenFilter
from jaxllm.lora.request import LoRARequest
from jaxllm.messages import EngineCoreRequest, FinishReason, ImageInput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxllm.core.beam_search import BeamGroup


def image_cache_token(mm_hash: str) -> int:
    """The prefix cache's token for each token of the image of hash `mm_hash`: negative,
    so never a vocabulary id, and 56 bits of the hash."""
    return -1 - int(mm_hash[:14], 16)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; recomputes from scratch
    FINISHED = "finished"


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
        lora_request: the adapter it runs under (its id is `lora_id`), for the runner.
        prompt_scores: the prompt logprob rows emitted so far, when the request asked
            for them (kept across preemption, so none is emitted twice).
        block_hashes: chained hashes of the request's leading full blocks (see
            :mod:`jaxllm.core.kv_cache_utils`). The KV cache manager fills it lazily,
            only when prefix caching is on, and only as far as it needs; since tokens
            are append-only an entry, once computed, stays valid. Nobody else writes it.
        structured: the grammar state of a request whose output is constrained
            (JSON schema, regex, choice, grammar); it waits until the grammar is ready.
        spec_token_ids: draft tokens proposed for its next step (speculative decoding);
            the scheduler schedules them after its last known token and drops them.
        num_output_placeholders: tokens sampled by steps still running (async
            scheduling): counted as the request's, their ids not yet known.
        queued_at, queue_seconds: when the core received it, and how long it waited
            before its first schedule (the queue-time metric; a preemption's wait is
            not counted, as vLLM's).
        beam: the beam search group of a beam (None for other requests).
        new_to_runner: a beam forked from another: the runner gets it whole (all its
            tokens and its block table) at its next schedule.
        chosen_token: a beam that continues as itself: the token the group chose for
            it, which replaces the one its row sampled (sent with its next schedule).
        pooling_params: a pooling request's (embeddings): its whole prompt is computed
            in one step and pooled, and it finishes there.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    cache_salt: str | None = None
    lora_id: int | None = None
    lora_request: LoRARequest | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    # --- scheduling (the KV cache manager does not read these) ---
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    max_tokens: int = 16  # resolved: max_tokens, or what max_model_len leaves
    seed: int = 0  # resolved: the user's seed, or one drawn by the engine
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_scores: PromptScores | None = None
    structured: StructuredOutputRequest | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    num_output_placeholders: int = 0
    beam: BeamGroup | None = None
    new_to_runner: bool = False
    chosen_token: int | None = None
    pooling_params: PoolingParams | None = None
    token_filter: TokenFilter | None = None  # allowed_token_ids, bad_words
    priority: int = 0  # the priority policy's: lower first
    arrival: int = 0  # the scheduler's count of requests added before it (ties of priority)
    queued_at: float = field(default_factory=time.monotonic)
    queue_seconds: float | None = None
    images: tuple[ImageInput, ...] = ()  # a vision-language model's (jaxllm.core.encoder_cache_manager)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_tokens: int, seed: int) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            cache_salt=req.cache_salt,
            lora_id=None if req.lora_request is None else req.lora_request.lora_int_id,
            lora_request=req.lora_request,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            max_tokens=max_tokens,
            seed=seed,
            prompt_scores=None if req.sampling_params.prompt_logprobs is None
            else PromptScores(req.sampling_params.prompt_logprobs),
            structured=None if req.sampling_params.structured_outputs is None
            else StructuredOutputRequest(req.sampling_params.structured_outputs),
            pooling_params=req.pooling_params,
            token_filter=TokenFilter.of(req.sampling_params),
            priority=req.priority,
            images=req.images,
        )

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens whose KV the request will hold: the last sampled token is
        never fed back (and with max_tokens=0 only the prompt is computed)."""
        return self.num_prompt_tokens + max(self.max_tokens, 1) - 1

    @property
    def samples_this_step(self) -> bool:
        """After scheduling: this step computes the request's last known token (and any
        draft tokens after it), so it samples the next one."""
        return self.num_computed_tokens >= self.num_tokens + self.num_output_placeholders

    @property
    def placeholders_reach_limit(self) -> bool:
        """Its tokens in flight (async scheduling) are the last it may have: another step
        would sample past max_tokens or max_model_len (the scheduler checks the latter)."""
        return self.num_output_tokens + self.num_output_placeholders >= self.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

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

    def cache_token_ids(self, start: int, end: int) -> list[int]:
        """``get_token_ids(start, end)`` as the prefix cache knows the tokens: an image's
        tokens (all the same id in the prompt) as a key of its content, so blocks of
        different images never match (`image_cache_token`)."""
        tokens = self.get_token_ids(start, end)
        for image in self.images:
            if image.overlaps(start, end):
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                tokens[lo - start:hi - start] = [image_cache_token(image.mm_hash)] * (hi - lo)
        return tokens

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append one sampled token id or several."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
