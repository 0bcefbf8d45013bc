"""Beam search in the engine core: one user request's beams as one group.

A beam search request starts as one scheduler request (its prompt). Each step every
live beam's row ranks its best continuations on the device (`ModelRunnerOutput.
beam_candidates`); once all of the group's live beams have reported, `BeamGroup.decide`
keeps the `width` best continuations by cumulative logprob, as transformers' beam search
does (`GenerationMixin._beam_search`, early_stopping=False):

- the candidates are ranked by the beam's cumulative logprob plus the token's;
- of the `width` best, those that end a sequence (a stop token, a stop string, or the
  length limit)
  become finished hypotheses scored cum_logprob / n ** length_penalty, n the generated
  tokens with the one that ended it; the `width` best hypotheses are kept;
- the `width` best candidates that end nothing are the next step's beams;
- the search ends when every candidate ends a sequence (the length limit), or when
  `width` hypotheses are kept and the best live beam's cum_logprob / n **
  length_penalty (n its generated tokens) does not beat the worst of them.

The scheduler applies a decision (`jaxllm.core.scheduler`): a beam chosen once
continues as the same request; a second child of the same parent is a fork, a new
request sharing the parent's full blocks and holding a copy of its partial last one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxllm.messages import BeamSequence, FinishReason
from jaxllm.stop_strings import find_stop

if TYPE_CHECKING:
    from jaxllm.core.request import Request

# token ids, skip_special_tokens -> text (the tokenizer's decode)
Decode = Callable[[list[int], bool], str]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One continuation: beam `parent` (an index into the group's beams) followed by `token`."""

    cum_logprob: float
    parent: int
    token: int


@dataclasses.dataclass(frozen=True)
class Choice:
    """A beam of the next step: `parent` (a live request) followed by `token`."""

    parent: Request
    token: int
    cum_logprob: float


class BeamGroup:
    """The live beams of one beam search request, and its finished hypotheses.

    Attributes:
        request_id: the user request's id (its beams' ids are derived from it).
        width: the beam width (SamplingParams.n).
        beams: the live beams, in rank order; all hold the same number of tokens.
        cum_logprobs: each live beam's cumulative logprob, by request id.
        reported: this step's candidates of the beams that sampled, by request id
            ((token ids, logprobs), best first); a beam that reported waits for the others.
        finished: the best hypotheses so far, best first (at most `width`).
    """

    def __init__(self, request: Request, decode: Decode | None = None) -> None:
        """`decode`: the text of token ids, for stop strings (needed when the request has any)."""
        params = request.sampling_params
        if params.stop and decode is None:
            raise ValueError("stop: stop strings need the tokenizer's decode")
        self.stop_strings = list(params.stop)
        self.skip_special_tokens = params.skip_special_tokens
        self._decode = decode
        self._texts: dict[str, str] = {}  # live beam id -> its generated text (stop strings)
        self.request_id = request.request_id
        self.width = params.n
        self.length_penalty = params.length_penalty
        self.min_tokens = params.min_tokens
        stops = {t: t for t in params.stop_token_ids}
        if request.eos_token_id is not None and not params.ignore_eos:
            stops[request.eos_token_id] = None
        self.stops: dict[int, int | None] = stops  # token -> stop_reason (None: EOS)
        self.seed = request  # the prompt's request (the first beam)
        self.beams: list[Request] = [request]
        self.cum_logprobs: dict[str, float] = {request.request_id: 0.0}
        self.reported: dict[str, tuple[list[int], list[float]]] = {}
        self.finished: list[BeamSequence] = []
        self._ids = itertools.count(1)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served (-1 before the prompt was scheduled)."""
        return self.seed.num_cached_tokens

    def next_beam_id(self) -> str:
        return f"{self.request_id}#beam{next(self._ids)}"

    def waits(self, request: Request) -> bool:
        """Whether a live beam has reported this step's candidates (it waits for the
        group's decision before it is scheduled again)."""
        return request.request_id in self.reported

    def report(self, request: Request, token_ids: list[int], logprobs: list[float]) -> None:
        self.reported[request.request_id] = (token_ids, logprobs)

    @property
    def ready(self) -> bool:
        """Every live beam has reported: the group can decide."""
        return len(self.reported) == len(self.beams)

    def _score(self, cum_logprob: float, num_tokens: int) -> float:
        return cum_logprob / num_tokens ** self.length_penalty

    def _ends(self, candidate: Candidate, limit: int) -> tuple[FinishReason, int | None] | None:
        """How `candidate` ends its sequence, if it does: a stop token (once min_tokens
        are generated), or the length limit (`limit` generated tokens)."""
        beam = self.beams[candidate.parent]
        n = beam.num_output_tokens + 1
        if candidate.token in self.stops and n > self.min_tokens:
            return FinishReason.STOP, self.stops[candidate.token]
        if self.stop_strings and n >= self.min_tokens:
            stop = self._stop_string(beam, candidate.token)
            if stop is not None:
                return FinishReason.STOP, stop
        if n >= limit:
            return FinishReason.LENGTH, None
        return None

    def _stop_string(self, beam: Request, token: int) -> str | None:
        """The stop string `token` completes after `beam`'s text (one ending in the
        token's text; the frontend's detokenizer cuts the returned text there)."""
        before = self._texts.get(beam.request_id)
        if before is None:
            before = self._texts[beam.request_id] = self._decode(beam.output_token_ids, self.skip_special_tokens)
        text = self._decode(beam.output_token_ids + [token], self.skip_special_tokens)
        found = find_stop(text, len(before), self.stop_strings)
        return None if found is None else found[0]

    def candidates(self) -> list[Candidate]:
        """Every reported continuation, best first (ties: earlier beam, better rank)."""
        found = [
            Candidate(self.cum_logprobs[beam.request_id] + lp, i, token)
            for i, beam in enumerate(self.beams)
            for token, lp in zip(*self.reported[beam.request_id])
            if lp != float("-inf")
        ]
        return sorted(found, key=lambda c: -c.cum_logprob)

    def decide(self, max_model_len: int) -> list[Choice]:
        """This step's decision, once `ready`: the next step's beams, best first (none
        when the search is over; `finished` then holds the result)."""
        head = self.beams[0]
        limit = min(head.max_tokens, max_model_len - head.num_prompt_tokens)
        n = head.num_output_tokens + 1  # the generated tokens with this step's
        ranked = self.candidates()
        ends = {}  # candidate -> how it ends (None: it does not)
        new = []
        for c in ranked[:self.width]:
            end = ends[c] = self._ends(c, limit)
            if end is not None:
                parent = self.beams[c.parent]
                new.append(BeamSequence(parent.output_token_ids + [c.token], c.cum_logprob,
                                        self._score(c.cum_logprob, n), *end))
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.width]
        live = []
        for c in ranked:
            if len(live) == self.width:
                break
            if (ends[c] if c in ends else self._ends(c, limit)) is None:
                live.append(c)
        self.reported, self._texts = {}, {}
        if not live:
            return []
        if len(self.finished) == self.width and self._score(live[0].cum_logprob, n) <= self.finished[-1].score:
            return []  # no live beam can beat the worst kept hypothesis (transformers' heuristic)
        return [Choice(self.beams[c.parent], c.token, c.cum_logprob) for c in live]

    def result(self) -> list[BeamSequence]:
        """The sequences to return, best first."""
        return list(self.finished)
