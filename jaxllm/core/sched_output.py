"""What the scheduler decided for one step, as the model runner needs it.

Requests the runner has not seen (new, or resumed after preemption) come with all
their tokens and their whole block table; requests it already holds come as a diff
(new blocks only). The runner keeps its own copy of each request's tokens and appends
the tokens it samples, so decodes need no token ids here.
"""

from __future__ import annotations

import dataclasses

from jaxllm.lora.request import LoRARequest
from jaxllm.messages import ImageInput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt, then outputs so far (a resumed request recomputes them)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    eos_token_id: int | None
    block_ids: tuple[list[int], ...]  # its block table, one per KV cache group
    num_computed_tokens: int  # before this step (prefix-cache hits count as computed)
    num_prompt_scored: int = 0  # prompt logprobs: positions scored already (score from here on)
    lora_request: LoRARequest | None = None  # the adapter it runs under
    pooling_params: PoolingParams | None = None  # a pooling request: pool its hidden states


@dataclasses.dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: tuple[list[int], ...]  # blocks allocated this step, one list per KV cache group
    num_computed_tokens: int  # before this step
    # beam search: the token the request's beam group chose after its last step, in place
    # of the one its row sampled (None: keep the sampled one)
    last_token_id: int | None = None


@dataclasses.dataclass
class EncoderInput:
    """An image the step encodes first, into rows `slot * tokens_per_image` on of the
    runner's image table (jaxllm.core.encoder_cache_manager)."""

    slot: int
    image: ImageInput


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the last step: drop their state
    preempted_req_ids: set[str]  # preempted this step: drop their state (they come back as new)
    # (source, destination) blocks whose K/V to copy before the step: a new request's
    # first block takes the tokens it shares with an earlier one's, a forked beam its
    # parent's partial last block (copy-on-write)
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # speculative decoding: the draft tokens each request computes after its last known
    # token this step (counted in num_scheduled_tokens), to be verified by the target
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # multi-step decode: every scheduled request decodes this many steps in one call (at
    # most num_scheduler_steps; fewer where its KV slots, held for that many, end sooner);
    # empty: one step
    decode_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    # a vision-language model's images: those to encode before the step, each into its
    # encoder cache slot; and per request whose scheduled tokens cover image tokens, each
    # such image as (its first token's position, its token count, its slot)
    encoder_inputs: list[EncoderInput] = dataclasses.field(default_factory=list)
    image_slots: dict[str, list[tuple[int, int, int]]] = dataclasses.field(default_factory=dict)

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs)

    @property
    def num_sample_rows(self) -> int:
        """Rows the step samples at: one per scheduled request, and one per draft token
        (the model runner's sample rows; a structured-output bitmask has as many)."""
        return len(self.num_scheduled_tokens) + sum(len(d) for d in self.scheduled_spec_decode_tokens.values())

    @property
    def num_steps(self) -> int:
        """The decode steps the call runs (1 unless several are handed over)."""
        return max(self.decode_steps.values(), default=1)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
