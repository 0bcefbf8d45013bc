"""What a user gets back: RequestOutput with one CompletionOutput per sample (n);
BeamSearchOutput from LLM.beam_search."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per generated position: token id -> Logprob, holding the sampled token and the top
# alternatives. Prompt logprobs: the same per prompt position (None for the first).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class BeamSearchSequence:
    """One sequence of a beam search, vLLM's fields: `tokens` and `text` are the whole
    sequence (the prompt's, then the generated ones; `output_token_ids` and
    `output_text` are the generated part alone), `cum_logprob` the generated tokens'
    summed logprob."""

    tokens: list[int]
    text: str
    cum_logprob: float
    output_token_ids: list[int]
    output_text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A beam search's result: its beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence]
