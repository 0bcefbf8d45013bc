"""SamplingParams: how one request is sampled and when it stops, as in vLLM.

Validated on construction: every error is a ValueError that names the field, raised
before any work is queued. Plain Python (the engine core process imports it too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxllm.structured_output.params import StructuredOutputsParams

__all__ = ["BeamSearchParams", "SamplingParams", "StructuredOutputsParams"]

MAX_LOGPROBS = 20  # top alternatives returned per token (OpenAI allows 20)
# Beam search: each beam's row ranks its best `width + stop tokens` continuations on the
# device, out of a fixed top-k of this many (jaxllm.sample.sampler.beam_candidates)
BEAM_CANDIDATES = 32
MAX_BEAM_WIDTH = BEAM_CANDIDATES // 2
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI allows 300)
MAX_STOP_TOKEN_IDS = 64
_EPS = 1e-5


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len; 0 = nothing generated (score the prompt)
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per sampled token (0 = the sampled one only)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (jaxllm.core.token_filter)
    # bad_words' token ids, as the tokenizer spells each word alone and after a space (the
    # engine's input processor fills it)
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as fit)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    # beam search (vLLM v0's names): n is the beam width; the n best sequences come back,
    # ranked by cum_logprob / len ** length_penalty (len: the generated tokens)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    # ------------------------------------------------------------------ checks

    def _validate(self) -> None:
        def fail(field: str, message: str) -> None:
            raise ValueError(f"{field}: {message}")

        def integer(field: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                fail(field, f"must be an integer, got {value!r}")

        def number(field: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(field, f"must be a number, got {value!r}")

        integer("n", self.n)
        if self.n < 1:
            fail("n", f"must be at least 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            number(name, getattr(self, name))
        if self.temperature < 0:
            fail("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        integer("top_k", self.top_k)
        if self.top_k < 0:
            fail("top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            fail("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None:
            integer("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                fail("seed", f"out of range: {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                fail("stop", f"must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            integer("stop_token_ids", t)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} entries, got {len(self.stop_token_ids)}")
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens)
            if self.max_tokens < 0:
                fail("max_tokens", f"must be non-negative (0 scores the prompt only), got {self.max_tokens}")
            if self.max_tokens == 0 and self.prompt_logprobs is None:
                fail("max_tokens", "0 generates nothing: it is only valid with prompt_logprobs set, to score the "
                                   "prompt")
        integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            fail("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                integer(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    fail(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not -100 <= bias <= 100:
                    fail("logit_bias", f"bias for token {token} must be in [-100, 100], got {bias}")
        self._validate_token_filters(fail, integer)
        if self.truncate_prompt_tokens is not None:
            integer("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                fail("truncate_prompt_tokens", f"must be at least 1, or -1 (as many as fit), got "
                                               f"{self.truncate_prompt_tokens}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", f"must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if not isinstance(self.use_beam_search, bool):
            fail("use_beam_search", f"must be true or false, got {self.use_beam_search!r}")
        number("length_penalty", self.length_penalty)
        if self.use_beam_search:
            self._validate_beam_search(fail)
        elif self.length_penalty != 1.0:
            fail("length_penalty", "only applies to beam search (use_beam_search)")

    def _validate_token_filters(self, fail, integer) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                fail("allowed_token_ids", f"must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                integer("allowed_token_ids", t)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list):
                fail("bad_words", f"must be a list of strings, got {self.bad_words!r}")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    fail("bad_words", f"must be non-empty strings, got {w!r}")

    def _validate_beam_search(self, fail) -> None:
        """What beam search refuses: sampling (it keeps the likeliest sequences), what
        it cannot rank by (penalties over a beam's own tokens, a grammar's state), and
        widths past what one step ranks on the device."""
        if self.n > MAX_BEAM_WIDTH:
            fail("n", f"the beam width must be at most {MAX_BEAM_WIDTH} with use_beam_search, got {self.n}")
        why = "beam search keeps the most likely sequences; it does not sample (leave it at its default)"
        if self.temperature != 0:
            fail("temperature", f"must be 0 with use_beam_search: {why}")
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0)):
            if getattr(self, name) != off:
                fail(name, f"must be {off} with use_beam_search: {why}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                fail(name, "is not supported with use_beam_search")
        if self.repetition_penalty != 1:
            fail("repetition_penalty", "is not supported with use_beam_search")
        for name in ("logprobs", "prompt_logprobs", "structured_outputs", "allowed_token_ids", "bad_words"):
            if getattr(self, name) is not None:
                fail(name, "is not supported with use_beam_search")
        if self.max_tokens == 0:
            fail("max_tokens", "must be at least 1 with use_beam_search")
        if self.n + len(set(self.stop_token_ids)) + 1 > BEAM_CANDIDATES:
            fail("stop_token_ids", f"with use_beam_search the beam width plus the stop tokens (and EOS) must be at "
                                   f"most {BEAM_CANDIDATES}, got n={self.n} and {len(self.stop_token_ids)} stop tokens")

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model or are too costly for every copy: token ids in
        range, a structured output's grammar compiled (a bad JSON schema, regex or grammar
        is a ValueError naming it)."""
        if self.structured_outputs is not None:
            self.structured_outputs.check()
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"{name}: token id {t} is out of range [0, {vocab_size})")

    def check_beam_width(self, max_num_seqs: int) -> None:
        """A beam search's width against the sequences an engine runs at once (its
        beams run together); ValueError naming n."""
        if self.use_beam_search and self.n > max_num_seqs:
            raise ValueError(f"n: a beam width of {self.n} needs {self.n} sequences at once, more than this engine "
                             f"runs (max_num_seqs={max_num_seqs})")

    # --------------------------------------------------------------- derived

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def num_beam_candidates(self) -> int:
        """Beam search: the continuations each beam ranks per step (0 without): enough
        that the width best which end no sequence are among them, whatever stop tokens
        take the top places (transformers keeps (1 + stop tokens) x width overall)."""
        return self.n + len(set(self.stop_token_ids)) + 1 if self.use_beam_search else 0

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s parameters, vLLM's names: the `beam_width` most likely
    sequences of at most `max_tokens` tokens, ranked by cum_logprob / len **
    `length_penalty`. `temperature` must be 0 (beam search does not sample)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self.to_sampling_params()  # every check, naming the field (beam_width as itself)

    def to_sampling_params(self) -> SamplingParams:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width: must be a positive integer, got {self.beam_width!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        return SamplingParams(
            n=self.beam_width, use_beam_search=True, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            temperature=self.temperature, length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=list(self.stop_token_ids), stop=list(self.stop), min_tokens=self.min_tokens,
            logit_bias=self.logit_bias)
