"""What a user gets back: RequestOutput with one CompletionOutput per sample (n);
BeamSearchOutput from LLM.beam_search; PoolingRequestOutput (and its embedding and
score forms) from a pooling model."""

from __future__ import annotations

import dataclasses

import numpy as np


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
    """A request's timestamps (time.monotonic()): it arrived, was first scheduled (its
    wait in the engine core's queue after arriving), got its first and its last token,
    finished."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class FinishedRequestStats:
    """A finished request as the serving metrics count it: its timestamps, its prompt's
    length, each returned sequence's finish reason and generated tokens (n samples, or a
    beam search's sequences), and the n and max_tokens it asked for."""

    metrics: RequestMetrics
    num_prompt_tokens: int
    finish_reasons: list[str]
    sample_tokens: list[int]
    n: int = 1
    max_tokens: int | None = None


@dataclasses.dataclass
class IterationStats:
    """What the frontend saw of one engine's requests since the metrics last took it:
    prompt tokens of requests that got their first token, tokens generated (those the
    user gets), each first token's latency, the gaps between a sequence's successive
    outputs, and the requests that finished."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)


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


@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's): `data`, float32, [D] for one vector (the
    pooled hidden state, or the embedding cut and normalized as asked), [tokens, D]
    for one per token."""

    data: np.ndarray


@dataclasses.dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result per prompt (vLLM's): `outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """LLM.score's result per pair (vLLM's): `outputs.score`, the cosine similarity of
    the two texts' embeddings; `prompt_token_ids` the two inputs' tokens, one after the
    other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
