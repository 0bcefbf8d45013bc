"""Plain data shared by the engine frontend (`engine/`), the engine core (`core/`) and
the model runner (`worker/`): requests as the core receives them, what it sends back,
finish reasons, logprob rows, scheduler statistics, and a step's results. The bottom of
the package: it imports nothing of jaxllm but `sampling_params`, `pooling_params` and
`lora.request` (plain data all), and everything cheap to serialize, so the core can live in its own
process."""

from __future__ import annotations

import dataclasses
import enum

from jaxllm.lora.request import LoRARequest
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the client or the engine

    def __str__(self) -> str:
        return self.value


def check_prompt(token_ids: list[int], *, vocab_size: int, max_model_len: int, generates: bool = True) -> None:
    """The checks every prompt passes, wherever it enters (the engine frontend, the
    server before it answers, the core); ValueError naming the field. A prompt that
    `generates` needs room for a token after it; one that is pooled does not."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("prompt: must not be empty")
    if not generates and n > max_model_len:
        raise ValueError(f"prompt: this model's maximum context length is {max_model_len} tokens, but the input has "
                         f"{n} tokens; shorten it or set truncate_prompt_tokens")
    if generates and n >= max_model_len:
        raise ValueError(f"prompt: this model's maximum context length is {max_model_len} tokens, "
                         f"but the prompt has {n} tokens (no room to generate)")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad} is out of range [0, {vocab_size})")


@dataclasses.dataclass
class ImageInput:
    """One image of a prompt (a vision-language model's), as the frontend prepared it:
    its pixel values (the model's image processor's, float32 bytes of `shape`: plain
    data over the wire), the hash of its content (two requests with the same image
    share its embeddings and prefix-cache blocks; with different ones, never), and where
    its image tokens are in the prompt."""

    mm_hash: str  # hex SHA-256 of the pixel values
    offset: int  # position of its first image token
    length: int  # its image tokens (the model's tokens per image)
    pixels: bytes  # float32, C-ordered
    shape: tuple[int, ...]  # [C, H, W]

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.offset + self.length


@dataclasses.dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    priority: int = 0  # under the priority scheduling policy: lower runs first
    # a pooling request (embeddings): its prompt is computed and pooled, nothing generated
    # (its sampling_params are not read: jaxllm.engine.input_processor.POOLING_SAMPLING)
    pooling_params: PoolingParams | None = None
    images: tuple[ImageInput, ...] = ()  # a vision-language model's, in prompt order

    def validate(self, *, vocab_size: int, max_model_len: int) -> None:
        """ValueError (naming the field) if the model cannot serve the request."""
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(self.sampling_params).__name__}")
        if self.pooling_params is not None and not isinstance(self.pooling_params, PoolingParams):
            raise ValueError(f"pooling_params: expected PoolingParams, got {type(self.pooling_params).__name__}")
        check_prompt(self.prompt_token_ids, vocab_size=vocab_size, max_model_len=max_model_len,
                     generates=self.pooling_params is None)
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected LoRARequest, got {type(self.lora_request).__name__}")
        self.sampling_params.validate_for_model(vocab_size)


@dataclasses.dataclass
class LogprobsLists:
    """Logprobs of several positions: row i holds the scored token first, then the
    top alternatives, and its rank among all tokens."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def first(self, n: int) -> LogprobsLists:
        """The rows of the first `n` positions (itself if it has no more)."""
        if len(self.ranks) <= n:
            return self
        return LogprobsLists(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])


@dataclasses.dataclass
class BeamSequence:
    """One sequence a beam search returns: its generated token ids (a stop token that
    ended it last), their summed logprob and its rank's score."""

    token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: FinishReason
    stop_reason: int | None = None


@dataclasses.dataclass
class PooledData:
    """A pooling request's result: float32 values (little-endian bytes, so the core
    needs no numpy to pass them on) of `shape`: [D] for one vector, [tokens, D] for one
    per token."""

    shape: list[int]
    data: bytes


@dataclasses.dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None  # for prompt positions computed this step
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    beams: list[BeamSequence] | None = None  # a finished beam search: its sequences, best first
    pooled: PooledData | None = None  # a finished pooling request: its vector(s)
    queue_seconds: float | None = None  # once scheduled: how long it waited in the core's queue first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class SpecDecodingStats:
    """Speculative decoding's running totals (vLLM's names): draft tokens proposed and
    accepted, over `num_drafts` verifications (request-steps with at least one draft);
    `accepted_per_pos[i]`: drafts accepted at position i of their step. Summed by `+`
    (data-parallel replicas)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        a, b = self.accepted_per_pos, other.accepted_per_pos
        width = max(len(a), len(b))
        a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
        return SpecDecodingStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens,
                                 tuple(x + y for x, y in zip(a, b)))

    def observe(self, num_draft_tokens: int, num_accepted: int) -> SpecDecodingStats:
        """These totals after one verification of `num_draft_tokens` drafts, the first
        `num_accepted` of them accepted."""
        per_pos = list(self.accepted_per_pos) + [0] * max(0, num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            per_pos[i] += 1
        return SpecDecodingStats(self.num_drafts + 1, self.num_draft_tokens + num_draft_tokens,
                                 self.num_accepted_tokens + num_accepted, tuple(per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: the accepted drafts plus the token the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclasses.dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_used: int = 0
    num_tokens_held: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # a vision-language model's encoder cache: images looked up, found encoded, encoded
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    images_encoded: int = 0
    spec_decoding: SpecDecodingStats = dataclasses.field(default_factory=SpecDecodingStats)
    running_lora_adapters: tuple[str, ...] = ()  # the adapters of running requests (names)
    waiting_lora_adapters: tuple[str, ...] = ()  # and of waiting ones


@dataclasses.dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    replica_stats: list[SchedulerStats] | None = None  # per data-parallel replica (jaxllm.engine.dp_client)
    # per replica, seconds since it last reported (outputs or its idle heartbeat): a stuck one's grows
    replica_report_ages: list[float] | None = None
    engine_index: int = 0  # the data-parallel replica that sent them
    step_tokens: int = 0  # tokens the step computed (prompt and generated), over all its requests


@dataclasses.dataclass
class ModelRunnerOutput:
    """Per scheduled request (in the step's row order): the tokens it gained, none for
    a prefill chunk that does not finish its prompt, one for a decode, and with draft
    tokens verified the accepted drafts and the target's next token; logprobs where
    requested (one row per token gained; one row per prompt position scored this step);
    the draft tokens proposed for each request's next step (speculative decoding)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = dataclasses.field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # beam search: each beam's best continuations this step, (token ids, logprobs) best first
    beam_candidates: dict[str, tuple[list[int], list[float]]] = dataclasses.field(default_factory=dict)
    # pooling requests (all their prompt computed this step): their pooled vector(s)
    pooled: dict[str, PooledData] = dataclasses.field(default_factory=dict)
