"""The frontend's output side: engine-core outputs in, user-facing RequestOutputs out.

Per request it keeps an IncrementalDetokenizer (text, stop strings, hold-back), the
logprobs in user form, and metrics; a request with n > 1 runs as n child requests in
the core whose outputs a ParentRequest merges under the parent's id.

Typical use by a frontend:

    if params.n == 1:
        processor.add_request(request, prompt, kind)
        core.add_request(request)
    else:
        parent = ParentRequest.from_request(request)
        for i, child in enumerate(fan_out(request, params.n)):
            processor.add_request(child, prompt, kind, parent=parent, index=i)
            core.add_request(child)
    ...
    processed = processor.process_outputs(core.step().outputs)
    core.abort_requests(processed.reqs_to_abort)
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from jaxllm.outputs import (
    CompletionOutput,
    FinishedRequestStats,
    IterationStats,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

SEED_RANGE = 2**64  # SamplingParams accepts seeds in [-2**63, 2**64)


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds."""

    CUMULATIVE = 0  # everything so far, every time
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output, once the request has finished (offline generate)


@dataclasses.dataclass
class ProcessedOutputs:
    """What one process_outputs call produced."""

    request_outputs: list[RequestOutput | PoolingRequestOutput]  # ready for the user, in arrival order
    reqs_to_abort: list[str]  # core request ids finished here by a stop string: abort them in the core


# ---------------------------------------------------------------------- n > 1


def fan_out(request: EngineCoreRequest, n: int) -> list[EngineCoreRequest]:
    """The n child core requests of a request: ids f"{request_id}-{i}", n=1 each;
    child i samples with seed + i when a seed is set. Only child 0 computes prompt
    logprobs (they are the same for all children)."""
    params = request.sampling_params
    children = []
    for i in range(n):
        seed = None if params.seed is None else _wrap_seed(params.seed + i)
        child_params = params.clone(n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if i == 0 else None)
        child_id = f"{request.request_id}-{i}"
        children.append(dataclasses.replace(request, request_id=child_id, sampling_params=child_params))
    return children


def core_requests(request: EngineCoreRequest) -> tuple[list[EngineCoreRequest], ParentRequest | None]:
    """The core requests a user request runs as, and their parent: itself (n = 1, or a
    beam search, whose beams the core runs as one group), else its n children."""
    params = request.sampling_params
    if params.n == 1 or params.use_beam_search:
        return [request], None
    return fan_out(request, params.n), ParentRequest.from_request(request)


def _wrap_seed(seed: int) -> int:
    """seed + i wrapped back into the range SamplingParams accepts."""
    return seed - SEED_RANGE if seed >= SEED_RANGE else seed


@dataclasses.dataclass
class ParentRequest:
    """A user request with n > 1 samples, run in the core as n child requests.

    Holds the parent's id, n, its children's core request ids, the latest completion of
    each child (for CUMULATIVE and FINAL_ONLY), the prompt logprobs (computed by one
    child), and the metrics its children share.
    """

    request_id: str
    n: int
    metrics: RequestMetrics
    child_ids: list[str] = dataclasses.field(default_factory=list)
    completions: dict[int, CompletionOutput] = dataclasses.field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    num_finished: int = 0
    finish_reasons: list[str] = dataclasses.field(default_factory=list)  # of finished children, for the metrics
    sample_tokens: list[int] = dataclasses.field(default_factory=list)  # and their generated tokens

    @classmethod
    def from_request(cls, request: EngineCoreRequest) -> ParentRequest:
        return cls(request.request_id, request.sampling_params.n, RequestMetrics(arrival_time=request.arrival_time))

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n

    def record(self, index: int, completion: CompletionOutput) -> list[CompletionOutput]:
        """Note a child's latest completion; return every child's latest, by index."""
        self.completions[index] = completion
        return [self.completions[i] for i in sorted(self.completions)]


# ------------------------------------------------------------------- logprobs


@dataclasses.dataclass
class LogprobsState:
    """One completion's logprobs in user form; a field is None when not requested."""

    tokenizer: Tokenizer | None  # renders decoded_token; None without detokenize
    num_logprobs: int | None  # top alternatives per sampled token
    num_prompt_logprobs: int | None  # top alternatives per prompt token
    logprobs: SampleLogprobs | None
    prompt_logprobs: PromptLogprobs | None  # first position None: nothing predicts it
    cumulative_logprob: float | None  # sum over the sampled tokens
    num_sent: int = 0  # DELTA: entries of logprobs already sent
    prompt_logprobs_sent: bool = False  # DELTA: prompt logprobs go out once

    @classmethod
    def from_request(cls, tokenizer: PreTrainedTokenizerFast, request: EngineCoreRequest) -> LogprobsState:
        params = request.sampling_params
        return cls(
            tokenizer=tokenizer.backend_tokenizer if params.detokenize else None,
            num_logprobs=params.logprobs,
            num_prompt_logprobs=params.prompt_logprobs,
            logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            cumulative_logprob=None if params.logprobs is None else 0.0,
        )

    def update(self, output: EngineCoreOutput) -> None:
        if self.logprobs is not None and output.new_logprobs is not None:
            rows = _to_user_logprobs(output.new_logprobs, self.num_logprobs or 0, self.tokenizer)
            self.logprobs.extend(rows)
            self.cumulative_logprob += sum(lps[0] for lps in output.new_logprobs.logprobs)
        if self.prompt_logprobs is not None and output.new_prompt_logprobs is not None:
            rows = _to_user_logprobs(output.new_prompt_logprobs, self.num_prompt_logprobs or 0, self.tokenizer)
            self.prompt_logprobs.extend(rows)

    def next_logprobs(self, delta: bool) -> SampleLogprobs | None:
        """All sample logprobs so far (a copy), or with delta those not sent yet."""
        if self.logprobs is None or not delta:
            return None if self.logprobs is None else list(self.logprobs)
        start, self.num_sent = self.num_sent, len(self.logprobs)
        return self.logprobs[start:]

    def next_prompt_logprobs(self, delta: bool) -> PromptLogprobs | None:
        """The prompt logprobs; with delta only the first time."""
        if not delta:
            return self.prompt_logprobs
        if self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs


def _to_user_logprobs(
    lists: LogprobsLists, num_alternatives: int, tokenizer: Tokenizer | None
) -> list[dict[int, Logprob]]:
    """Rows of (scored token, top alternatives...) -> token id -> Logprob dicts.

    The scored token keeps the rank the core computed; alternative j (1-based) has
    rank j. Rows may carry more alternatives than the request asked for (the core pads
    to the batch's maximum); the extra ones are dropped.
    """
    rows = [ids[: 1 + num_alternatives] for ids in lists.token_ids]
    texts: list[str | None]
    if tokenizer is None:
        texts = [None] * sum(map(len, rows))
    else:
        texts = tokenizer.decode_batch([[t] for ids in rows for t in ids], skip_special_tokens=False)
    result = []
    pos = 0
    for ids, logprobs, rank in zip(rows, lists.logprobs, lists.ranks):
        row = {ids[0]: Logprob(logprobs[0], rank, texts[pos])}
        for j in range(1, len(ids)):
            row.setdefault(ids[j], Logprob(logprobs[j], j, texts[pos + j]))
        result.append(row)
        pos += len(ids)
    return result


# -------------------------------------------------------------- per request


@dataclasses.dataclass
class RequestState:
    """What the output processor tracks for one core request (one completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    parent: ParentRequest | None
    index: int  # the completion's index among the parent's n (0 without a parent)
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsState
    metrics: RequestMetrics  # the parent's, shared, when there is one
    params: SamplingParams | None = None
    num_cached_tokens: int = 0
    num_tokens_sent: int = 0  # DELTA: token ids already sent
    engine_index: int = 0  # the data-parallel replica running it (the metrics' engine label)
    last_token_time: float | None = None  # this sequence's latest token (inter-token latency)

    def make_completion(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> CompletionOutput:
        """This completion as the user sees it now (advances the DELTA offsets)."""
        delta = self.output_kind is RequestOutputKind.DELTA
        finished = finish_reason is not None
        token_ids = self.detokenizer.token_ids
        if delta:
            token_ids, self.num_tokens_sent = token_ids[self.num_tokens_sent :], len(token_ids)
        else:
            token_ids = list(token_ids)
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_next_output_text(finished, delta),
            token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=self.logprobs.next_logprobs(delta),
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
        )


# ------------------------------------------------------------------ processor


class OutputProcessor:
    """Turns engine-core outputs into RequestOutputs for the requests it tracks.

    Holds one RequestState per unfinished core request and the ParentRequest of each
    unfinished n > 1 request. A request stops being tracked when it finishes (core
    finish, stop string, or abort); later core outputs for it are ignored.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, log_stats: bool = False) -> None:
        """`log_stats`: keep IterationStats for the serving metrics (`take_stats`)."""
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.log_stats = log_stats
        self._stats: dict[int, IterationStats] = {}  # by engine index, since take_stats

    def take_stats(self) -> dict[int, IterationStats]:
        """What happened since the last call, per engine (data-parallel replica)."""
        stats, self._stats = self._stats, {}
        return stats

    def _stats_of(self, state: RequestState) -> IterationStats | None:
        if not self.log_stats:
            return None
        return self._stats.setdefault(state.engine_index, IterationStats())

    def get_num_unfinished_requests(self) -> int:
        """Unfinished core requests (an n > 1 request counts its unfinished children)."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Track a core request; `parent` and `index` for the children of fan_out."""
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
            parent.child_ids.append(request.request_id)
        self.request_states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=output_kind,
            parent=parent,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params),
            logprobs=LogprobsState.from_request(self.tokenizer, request),
            metrics=parent.metrics if parent is not None else RequestMetrics(arrival_time=request.arrival_time),
            params=request.sampling_params,
        )

    def process_outputs(self, outputs: list[EngineCoreOutput], engine_index: int = 0) -> ProcessedOutputs:
        """Detokenize, check stop strings, and make the RequestOutputs that are due
        (`engine_index`: the data-parallel replica that sent `outputs`)."""
        processed = ProcessedOutputs(request_outputs=[], reqs_to_abort=[])
        now = time.monotonic()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            state.engine_index = engine_index
            self._record_times(state, output, now)
            state.num_cached_tokens = output.num_cached_tokens
            if output.beams is not None:
                processed.request_outputs.append(self._emit_beams(state, output, now))
                continue
            if output.pooled is not None:
                processed.request_outputs.append(self._emit_pooled(state, output, now))
                continue
            num_before = len(state.detokenizer.token_ids)
            stop_string = state.detokenizer.update(output.new_token_ids, output.finish_reason is FinishReason.STOP)
            kept = len(state.detokenizer.token_ids) - num_before  # fewer where a stop string ended them
            if kept < len(output.new_token_ids) and output.new_logprobs is not None:
                output = dataclasses.replace(output, new_logprobs=output.new_logprobs.first(kept))
            state.logprobs.update(output)
            if (stats := self._stats_of(state)) is not None:
                stats.num_generation_tokens += kept
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            if stop_string is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_string
                if not output.finished:
                    processed.reqs_to_abort.append(output.request_id)
            if finish_reason is None and not output.new_token_ids:
                continue  # a prefill chunk: its prompt logprobs go out with the first token
            request_output = self._emit(state, finish_reason, stop_reason, now)
            if request_output is not None:
                processed.request_outputs.append(request_output)
        return processed

    def _record_times(self, state: RequestState, output: EngineCoreOutput, now: float) -> None:
        """The request's first schedule (from the core's queue time) and token times;
        with log_stats, its first-token and inter-token latencies."""
        m = state.metrics
        if m.first_scheduled_time is None and output.queue_seconds is not None:
            m.first_scheduled_time = m.arrival_time + output.queue_seconds
        if not output.new_token_ids and output.beams is None:
            return
        stats = self._stats_of(state)
        if m.first_token_time is None:
            m.first_token_time = now
            if stats is not None:
                stats.time_to_first_tokens.append(now - m.arrival_time)
                stats.num_prompt_tokens += len(state.prompt_token_ids)
        elif stats is not None and state.last_token_time is not None:
            stats.inter_token_latencies.append(now - state.last_token_time)
        m.last_token_time = state.last_token_time = now

    def _record_finished(self, state: RequestState, finish_reason: FinishReason, now: float) -> None:
        """A sequence finished: with log_stats, its request's FinishedRequestStats once
        all its sequences have (an n > 1 request's, when its last child finishes)."""
        parent = state.parent
        if parent is None or parent.finished:
            state.metrics.finished_time = now
        if (stats := self._stats_of(state)) is None:
            return
        reasons, tokens = [str(finish_reason)], [len(state.detokenizer.token_ids)]
        if parent is not None:
            parent.finish_reasons += reasons
            parent.sample_tokens += tokens
            if not parent.finished:
                return
            reasons, tokens = parent.finish_reasons, parent.sample_tokens
        if state.metrics.first_token_time is None and finish_reason is not FinishReason.ABORT:
            stats.num_prompt_tokens += len(state.prompt_token_ids)  # scored, no token generated (max_tokens 0)
        max_tokens = None if state.params is None else state.params.max_tokens
        stats.finished.append(FinishedRequestStats(state.metrics, len(state.prompt_token_ids), reasons, tokens,
                                                   len(reasons), max_tokens))

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish the named requests with finish_reason "abort" (held-back text is
        flushed) and return their final RequestOutputs. Takes core request ids or the
        ids of n > 1 parents (all of whose unfinished children are aborted); ids no
        longer tracked are skipped. Aborting them in the core is the caller's job."""
        request_outputs = []
        now = time.monotonic()
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            for child_id in parent.child_ids if parent is not None else [request_id]:
                state = self.request_states.get(child_id)
                if state is None:
                    continue
                request_output = self._emit(state, FinishReason.ABORT, None, now)
                if request_output is not None:
                    request_outputs.append(request_output)
        return request_outputs

    def _emit_beams(self, state: RequestState, output: EngineCoreOutput, now: float) -> RequestOutput:
        """A finished beam search: one completion per sequence, best first."""
        del self.request_states[state.request_id]
        completions = []
        for i, beam in enumerate(output.beams):
            # each sequence's text as a request's (stop token's and string's text cut unless
            # include_stop_str_in_output)
            text = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, state.params)
            text.update(beam.token_ids, beam.finish_reason is FinishReason.STOP and not isinstance(beam.stop_reason, str))
            completions.append(CompletionOutput(
                index=i, text=text.get_next_output_text(finished=True, delta=False), token_ids=list(beam.token_ids),
                cumulative_logprob=beam.cum_logprob, finish_reason=str(beam.finish_reason),
                stop_reason=beam.stop_reason))
        state.metrics.finished_time = now
        if (stats := self._stats_of(state)) is not None:
            stats.num_generation_tokens += sum(len(c.token_ids) for c in completions)
            stats.finished.append(FinishedRequestStats(
                state.metrics, len(state.prompt_token_ids), [c.finish_reason for c in completions],
                [len(c.token_ids) for c in completions], state.params.n, state.params.max_tokens))
        return RequestOutput(request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
                             outputs=completions, finished=True, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics)

    def _emit_pooled(self, state: RequestState, output: EngineCoreOutput, now: float) -> PoolingRequestOutput:
        """A finished pooling request: its vector(s) as a float32 array."""
        del self.request_states[state.request_id]
        state.metrics.finished_time = now  # no token: no first-token time
        if (stats := self._stats_of(state)) is not None:
            stats.num_prompt_tokens += len(state.prompt_token_ids)  # computed, though no token follows
            stats.finished.append(FinishedRequestStats(state.metrics, len(state.prompt_token_ids), ["stop"], [0]))
        data = np.frombuffer(output.pooled.data, "<f4").reshape(output.pooled.shape)
        return PoolingRequestOutput(state.request_id, PoolingOutput(data), state.prompt_token_ids, True, state.prompt,
                                    state.metrics)

    def _emit(
        self, state: RequestState, finish_reason: FinishReason | None, stop_reason: int | str | None, now: float
    ) -> RequestOutput | None:
        """The RequestOutput due after an update of `state`, if any; forgets the
        request when it has finished."""
        finished = finish_reason is not None
        parent = state.parent
        if finished:
            del self.request_states[state.request_id]
            if parent is not None:
                parent.num_finished += 1
                if parent.finished:
                    del self.parent_requests[parent.request_id]
            self._record_finished(state, finish_reason, now)
        if state.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = state.make_completion(finish_reason, stop_reason)
        delta = state.output_kind is RequestOutputKind.DELTA
        prompt_logprobs = state.logprobs.next_prompt_logprobs(delta)
        if parent is None:
            completions = [completion]
        else:
            finished = parent.finished
            if delta:
                completions = [completion]
            else:
                completions = parent.record(state.index, completion)
                if prompt_logprobs is not None:
                    parent.prompt_logprobs = prompt_logprobs
                prompt_logprobs = parent.prompt_logprobs
                if state.output_kind is RequestOutputKind.FINAL_ONLY and not finished:
                    return None
        return RequestOutput(
            request_id=parent.request_id if parent is not None else state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
