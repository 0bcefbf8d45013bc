"""The continuous-batching scheduler (vLLM v1 style: no prefill and decode phases).

Every request has num_computed_tokens and a target (all its tokens); each step hands
out tokens under a budget (max_num_batched_tokens) and a cap on running sequences
(max_num_seqs): running requests first, in admission order, then waiting ones (FCFS).
A long prompt is computed in chunks over several steps, mixed with decodes in the same
ragged batch. When the KV cache cannot give a running request its slots, the most
recently admitted running request is preempted: its blocks are freed and it goes back
to the head of the waiting queue, to be recomputed later (its prefix may still hit
the prefix cache).

Under the priority policy (vLLM's `--scheduling-policy priority`) the waiting queue is
ordered by (priority, arrival), lower first, a preempted request going back to its
place in that order, and the running request preempted is the last of that order.

Paused (`pause`, for a weight update between rollouts), the scheduler admits no
request that arrived after the pause; "wait" lets those before it run to the end,
"keep" holds them all where they are (or, `preempt_all`, recomputes them after
`resume`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable

from jaxllm.core.beam_search import BeamGroup, Choice, Decode
from jaxllm.core.block_contents import common_prefix
from jaxllm.core.encoder_cache_manager import EncoderCacheManager
from jaxllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxllm.core.kv_cache_manager import ComputedPrefix, KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.sched_output import CachedRequestData, EncoderInput, NewRequestData, SchedulerOutput
from jaxllm.core.structured_output import Grammar
from jaxllm.core.token_filter import TokenFilter
from jaxllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerStats,
    SpecDecodingStats,
)

logger = logging.getLogger(__name__)

_WAIT = object()  # _admit: the request waits for this step's writes


def _adapter_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The LoRA adapters `requests` run under, by name, each once, sorted."""
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager | HybridKVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int = 0,
        num_scheduler_steps: int = 1,
        decode: Decode | None = None,
        policy: str = "fcfs",
        encoder_cache: EncoderCacheManager | None = None,
        max_images_per_step: int = 0,
        whole_images: bool = False,
    ) -> None:
        """`max_loras` > 0: LoRA adapters are served, at most that many distinct ones
        in the running batch (the model runner's device slots); a request whose
        adapter finds no room waits, and those behind it go ahead.
        `num_scheduler_steps` > 1: when every running request decodes and none could
        be admitted, a step hands the runner up to that many decode steps at once
        (`_num_decode_steps`; the model runner's decode loop). `decode`: the
        tokenizer's, for beam searches with stop strings. `encoder_cache`: a
        vision-language model's (its images' embeddings); a step encodes at most
        `max_images_per_step` images; `whole_images` (Gemma 3, whose image tokens attend
        both ways): a step computes all of an image's tokens it has not cached or none,
        of at most `max_images_per_step` images."""
        self.kv_cache_manager = kv_cache_manager
        self.decode = decode
        self.policy = policy  # "fcfs" or "priority"
        self._arrivals = itertools.count()
        self.num_scheduler_steps = num_scheduler_steps
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the tail is preempted first
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        self.num_preemptions = 0
        # the token lists of the blocks the step being scheduled writes, by parent key,
        # while a request scoring its prompt waits (it may reuse them after the step)
        self._in_flight: dict[bytes, list[list[int]]] | None = None
        # the same of steps scheduled and not yet updated (async scheduling: the step
        # running while the next is scheduled), by id of their SchedulerOutput
        self._unrecorded: dict[int, dict[bytes, list[list[int]]]] = {}
        self._cached_this_step: list = []  # blocks the last schedule() entered into the prefix cache
        self._block_copies: list[tuple[int, int]] = []  # (source, destination) of this step's tails
        self._grammar_failures: list[EngineCoreOutput] = []  # aborted for their grammar, reported next update
        self.beam_groups: dict[str, BeamGroup] = {}  # beam search requests, by the user request's id
        self._fork_copies: dict[str, list[tuple[int, int]]] = {}  # forked beams' tail copies, not yet made
        self.spec_stats = SpecDecodingStats()
        # pause(): None (scheduling), "wait" (only requests that arrived before the pause
        # run, to their end) or "keep" (nothing runs); _pause_arrival: the first held arrival
        self.paused: str | None = None
        self._pause_arrival = 0
        self.encoder_cache = encoder_cache
        self.max_images_per_step = max_images_per_step
        self.whole_images = whole_images
        self._images_in_step = 0  # whole_images: the images this step computes tokens of
        self._encoder_inputs: list[EncoderInput] = []  # this step's images to encode
        self._image_slots: dict[str, list[tuple[int, int, int]]] = {}  # this step's (offset, length, slot) by request
        self._image_releases: list[tuple[str, str]] = []  # (image hash, request id) once this step is scheduled

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never fit in the KV cache."""
        if request.request_id in self.requests or request.request_id in self.beam_groups:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.kv_cache_manager.check_fits(request, self.max_kv_tokens(request))
        if request.sampling_params.use_beam_search:
            request.beam = self.beam_groups[request.request_id] = BeamGroup(request, self.decode)
        self.requests[request.request_id] = request
        request.arrival = next(self._arrivals)
        self._enqueue(request)

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        """Into the waiting queue: at its end (a preempted request: at its head), or under
        the priority policy at its place by (priority, arrival): after its equals, a
        preempted one before them (a beam group, preempted last beam first, keeps its
        order)."""
        if self.policy == "priority":
            key = (request.priority, request.arrival)
            after = (lambda k: k >= key) if preempted else (lambda k: k > key)
            at = next((i for i, r in enumerate(self.waiting) if after((r.priority, r.arrival))), len(self.waiting))
            self.waiting.insert(at, request)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def max_kv_tokens(self, request: Request) -> int:
        """The most tokens whose K/V the request may need at once: a beam search's
        width times a sequence's, as a preempted group is recomputed beam by beam (its
        beams share blocks only through the prefix cache then), so it always fits an
        empty pool again."""
        return request.max_kv_tokens * (request.sampling_params.n if request.sampling_params.use_beam_search else 1)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in request_ids:
            group = self.beam_groups.pop(req_id, None)
            if group is not None:
                for beam in group.beams:
                    self._drop_beam(beam)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT))
                continue
            request = self.requests.get(req_id)
            if request is None or request.beam is not None:  # a beam: aborted with its group
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
            outputs.append(self._output(request, [], None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would schedule anything: requests that are not held by a pause."""
        if self.paused == "keep":
            return False
        if self.paused == "wait":
            return any(r.arrival < self._pause_arrival for r in self.requests.values())
        return bool(self.requests)

    # -------------------------------------------------------------------- pause

    def pause(self, keep: bool) -> None:
        """Admit no request arriving from now on until `resume`; `keep`: run none of those
        already here either (they keep their places and their KV), else let them run to
        their end ("wait")."""
        if self.paused is None:
            self._pause_arrival = next(self._arrivals)
        self.paused = "keep" if keep else ("wait" if self.paused is None else self.paused)

    def resume(self) -> None:
        self.paused = None

    def preempt_all(self) -> list[str]:
        """Preempt every running request (between steps): each goes back to the waiting
        queue in its order, to be recomputed from its tokens; the ids preempted."""
        victims, self.running = self.running, []
        for request in reversed(victims):  # the last first: they keep their order at the head
            self._preempt(request)
            self.finished_req_ids.add(request.request_id)  # the runner drops what it holds of it
        return [r.request_id for r in victims]

    # ----------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        self._cached_this_step = []
        self._block_copies = [c for copies in self._fork_copies.values() for c in copies]
        scoring_waits = self.kv_cache_manager.enable_caching and any(
            r.prompt_scores is not None for r in self.waiting)
        self._in_flight = {} if scoring_waits else None
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        num_steps, decode_steps = self._num_decode_steps(), {}

        i, group_with_room = 0, None
        while i < len(self.running) and budget > 0 and self.paused != "keep":
            request = self.running[i]
            if self._waits_for_its_tokens(request) or (request.beam is not None and request.beam.waits(request)):
                i += 1
                continue
            if request.beam is not None and request.beam is not group_with_room:
                group_with_room = request.beam
                if not self._room_for_beams(request.beam, i, budget, preempted):
                    continue  # the group itself was preempted (it was the tail)
            drafts, request.spec_token_ids = request.spec_token_ids, []
            known = request.num_tokens + request.num_output_placeholders  # with the tokens of steps in flight
            num_new = self._fit_images(request, request.num_computed_tokens,
                                       min(known + len(drafts) - request.num_computed_tokens, budget))
            if num_new == 0:  # its next tokens are an image the step cannot encode
                request.spec_token_ids = drafts
                i += 1
                continue
            steps, new_blocks = self._allocate_steps(request, num_steps) if num_steps > 1 else (1, None)
            if new_blocks is None:  # one step's slots (the pool could not give it more)
                steps, new_blocks = 1, self._allocate_or_preempt(request, num_new, preempted)
            if new_blocks is None:  # the request itself was preempted (it was the tail)
                break
            num_drafts = request.num_computed_tokens + num_new - known  # what the budget left of them
            if num_drafts > 0:
                spec_tokens[request.request_id] = drafts[:num_drafts]
            if request.new_to_runner:  # a forked beam: the runner gets it whole
                new_reqs.append(self._new_request_data(request))
            else:
                cached_reqs.append(CachedRequestData(
                    request.request_id, self.kv_cache_manager.new_block_ids(new_blocks), request.num_computed_tokens,
                    last_token_id=request.chosen_token))
            request.new_to_runner, request.chosen_token = False, None
            self._advance(request, num_new, num_scheduled)
            if num_steps > 1:
                decode_steps[request.request_id] = steps
                request.num_computed_tokens += steps - 1  # the loop computes the K/V of all but its last token
            budget -= num_new
            i += 1

        # No admissions in a step that had to preempt: the pool is under pressure.
        deferred: list[Request] = []
        seats = self._seats_taken()
        while not preempted and self.waiting and budget > 0 and self.paused != "keep":
            request = self.waiting[0]
            if self.paused is not None and request.arrival >= self._pause_arrival:
                deferred.append(self.waiting.popleft())  # arrived after the pause: held until resume
                continue
            seats_needed = self._seats_needed(request)
            if seats + seats_needed > self.max_num_seqs or not self._beams_fit(request):
                break
            if request.num_output_placeholders:  # preempted while a step ran: its token comes first
                deferred.append(self.waiting.popleft())
                continue
            if request.structured is not None and not request.structured.ready:
                deferred.append(self.waiting.popleft())  # its grammar is compiling: the others go on
                continue
            if request.structured is not None and request.structured.error is not None:
                self._fail_grammar(self.waiting.popleft())
                continue
            if not self._lora_fits(request):
                deferred.append(self.waiting.popleft())  # its adapter waits for a slot: the others go on
                continue
            if request.pooling_params is not None and request.num_tokens > budget:
                # pooled whole in one step: it keeps its place for the next step, and shorter
                # ones behind it fill this one (each finishes in its step; a few are looked at)
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.max_num_seqs:
                    break
                continue
            admitted = self._admit(request, budget, num_scheduled)
            if admitted is _WAIT:
                deferred.append(self.waiting.popleft())
                continue
            if admitted is None:
                break
            new_reqs.append(admitted)
            budget -= num_scheduled[request.request_id]
            seats += seats_needed
        self.waiting.extendleft(reversed(deferred))
        written, self._in_flight = self._in_flight, None

        finished, self.finished_req_ids = self.finished_req_ids, set()
        encoder_inputs, image_slots = self._end_image_step()
        sched = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            block_copies=self._block_copies,
            scheduled_spec_decode_tokens=spec_tokens,
            decode_steps=decode_steps,
            encoder_inputs=encoder_inputs,
            image_slots=image_slots,
        )
        if not sched.is_empty:
            self._fork_copies = {}  # made before this step (an empty step writes nothing: they wait)
        if written and not sched.is_empty:
            self._unrecorded[id(sched)] = written
            while len(self._unrecorded) > 2:  # at most one step runs ahead: an older one was dropped
                del self._unrecorded[next(iter(self._unrecorded))]
        return sched

    def _num_decode_steps(self) -> int:
        """The decode steps this schedule may hand over at once: num_scheduler_steps
        when every running request decodes one token (no drafts, no grammar: its next
        bitmask needs this token), all fit the budget, and no waiting request could be
        admitted; fewer where a request would cross min_tokens (the loop keeps each
        row's stop-token suppression as it starts), or where a request reaches its
        max_tokens or max_model_len first (the loop ends with it: its client has its
        answer and its slot is refilled without waiting out the others' steps), or the
        pool could run short of slots; else 1."""
        k, running = self.num_scheduler_steps, self.running
        if (k == 1 or not running or len(running) > self.max_num_batched_tokens
                or (self.waiting and len(running) < self.max_num_seqs)):
            return 1
        for request in running:
            known = request.num_tokens + request.num_output_placeholders
            if (request.spec_token_ids or request.structured is not None or request.beam is not None
                    or request.token_filter is not None
                    or known - request.num_computed_tokens != 1 or self._waits_for_its_tokens(request)):
                return 1
            produced = request.num_output_tokens + request.num_output_placeholders
            below = request.sampling_params.min_tokens - produced
            if below > 0:
                k = min(k, below)
            k = min(k, request.max_tokens - produced, self.max_model_len - known)
        kv = self.kv_cache_manager
        most = len(running) * kv.num_groups * (-(-k // kv.block_size) + 1)  # new blocks k slots may take
        return k if k > 1 and most <= kv.num_free_blocks else 1

    def _allocate_steps(self, request: Request, num_steps: int) -> tuple[int, list | None]:
        """Slots for up to `num_steps` decode steps of `request` (no more than its
        max_tokens allows): how many, and the new blocks (None: the pool had not
        enough; nothing allocated)."""
        room = request.max_tokens - request.num_output_tokens - request.num_output_placeholders
        steps = max(1, min(num_steps, room))
        return steps, self.kv_cache_manager.allocate_slots(request, steps)

    def _waits_for_its_tokens(self, request: Request) -> bool:
        """Async scheduling: the request's tokens in flight are its last (max_tokens,
        max_model_len), or it has nothing new to compute; it finishes when they come."""
        if not request.num_output_placeholders:
            return False
        known = request.num_tokens + request.num_output_placeholders
        return request.placeholders_reach_limit or known >= self.max_model_len or known <= request.num_computed_tokens

    def add_placeholders(self, sched: SchedulerOutput) -> None:
        """Async scheduling, once the step of `sched` is dispatched: each request it
        samples for holds a token in flight, which the next schedule counts as known
        (its id comes with `update_from_output`)."""
        for req_id in sched.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.samples_this_step:
                request.num_output_placeholders += sched.decode_steps.get(req_id, 1)

    def _lora_fits(self, request: Request) -> bool:
        """Whether admitting `request` keeps the running batch within max_loras adapters."""
        if request.lora_id is None:
            return True
        running = {r.lora_id for r in self.running if r.lora_id is not None}
        return request.lora_id in running or len(running) < self.max_loras

    def _fail_grammar(self, request: Request) -> None:
        logger.error("request %s: its structured output could not be compiled: %s", request.request_id,
                     request.structured.error)
        self._finish(request, FinishReason.ABORT)
        self._grammar_failures.append(self._output(request, [], None))

    def constrained_rows(self, sched: SchedulerOutput) -> list[tuple[int, Grammar, list[int]]]:
        """(first sample row, grammar, draft tokens) of the scheduled requests that sample
        under a grammar this step: those rows need a token bitmask, one per position a
        drafted request samples at (the model runner's order: `num_scheduled_tokens`'
        requests, each 1 + its drafts sample rows; `SchedulerOutput.num_sample_rows`)."""
        rows, row = [], 0
        for req_id in sched.num_scheduled_tokens:
            request = self.requests[req_id]
            s, drafts = request.structured, sched.scheduled_spec_decode_tokens.get(req_id, [])
            if s is not None and s.grammar is not None and request.samples_this_step and s.grammar.constrains:
                rows.append((row, s.grammar, drafts))
            row += 1 + len(drafts)
        return rows

    def filtered_rows(self, sched: SchedulerOutput) -> list[tuple[int, TokenFilter, list[int], list[int]]]:
        """(first sample row, token filter, output so far, draft tokens) of the scheduled
        requests that sample under allowed_token_ids or bad_words this step (the rows of
        `constrained_rows`)."""
        rows, row = [], 0
        for req_id in sched.num_scheduled_tokens:
            request = self.requests[req_id]
            drafts = sched.scheduled_spec_decode_tokens.get(req_id, [])
            if request.token_filter is not None and request.samples_this_step:
                rows.append((row, request.token_filter, request.output_token_ids, list(drafts)))
            row += 1 + len(drafts)
        return rows

    def _admit(self, request: Request, budget: int, num_scheduled: dict[str, int]):
        """Take the head of the waiting queue into the running batch with the prefix it
        can reuse and slots for its first chunk. None if the pool cannot hold that
        chunk; ``_WAIT`` if it scores its prompt and would reuse more of it after this
        step (lm-eval sends the choices of one question together)."""
        kv = self.kv_cache_manager
        scores = request.prompt_scores
        prefix = kv.get_computed_prefix(request, None if scores is None else self._scored_prefix(request))
        if scores is not None and self._worth_waiting(request, prefix.num_tokens):
            return _WAIT
        num_hit_tokens = prefix.num_tokens
        num_new = self._fit_images(request, num_hit_tokens, min(request.num_tokens - num_hit_tokens, budget))
        if num_new == 0:
            return _WAIT  # its first tokens are an image the step cannot encode: the others go on
        if request.pooling_params is not None and num_new < request.num_tokens - num_hit_tokens:
            return None  # pooled whole, in one step (an encoder's attention sees the whole sequence)
        new_blocks = kv.allocate_slots(request, num_new, num_hit_tokens, prefix.hits, prefix.num_tail_tokens)
        if new_blocks is None:
            return None
        kv.count_lookup(request, num_hit_tokens)
        if prefix.num_tail_tokens:
            self._block_copies.append((prefix.tail.block_id, new_blocks[0].block_id))
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.queue_seconds is None:
            request.queue_seconds = time.monotonic() - request.queued_at
        if scores is not None:
            scores.fill(prefix.records, request.all_token_ids, request.num_prompt_tokens, kv.block_size, num_hit_tokens)
        new = self._new_request_data(request)
        self._advance(request, num_new, num_scheduled)
        return new

    def _new_request_data(self, request: Request) -> NewRequestData:
        """What the runner needs of a request it does not hold (before this step's tokens)."""
        scores = request.prompt_scores
        return NewRequestData(
            req_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            seed=request.seed,
            eos_token_id=request.eos_token_id,
            block_ids=self.kv_cache_manager.group_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            num_prompt_scored=0 if scores is None else len(scores.rows),
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

    def _scored_prefix(self, request: Request):
        """For a request scoring its prompt: the part of a reusable prefix whose
        prompt rows are known (scored already, or recorded with the blocks)."""
        scores, bs = request.prompt_scores, self.kv_cache_manager.block_size

        def choose(prefix: ComputedPrefix) -> ComputedPrefix:
            length = scores.reusable(prefix.records, request.all_token_ids, request.num_prompt_tokens, bs,
                                     prefix.num_tokens)
            num_blocks, num_tail = divmod(length, bs)
            tail = None
            if num_tail:
                tail = prefix.blocks[num_blocks] if num_blocks < len(prefix.blocks) else prefix.tail
            # the records stay whole: the row predicting token `length` is in the next one
            return ComputedPrefix(prefix.blocks[:num_blocks], bs, tail, num_tail, prefix.records)

        return choose

    def _worth_waiting(self, request: Request, num_reusable: int) -> bool:
        """Whether a request scoring its prompt would reuse more of it after this step:
        a block this step writes shares more of its next tokens than it reuses now."""
        steps = [w for w in (self._in_flight, *self._unrecorded.values()) if w]
        if not steps or num_reusable >= request.num_tokens - 1:
            return False
        kv, bs = self.kv_cache_manager, self.kv_cache_manager.block_size
        j = (num_reusable + 1) // bs  # the block of the first token whose row it lacks
        tokens = request.cache_token_ids(j * bs, min((j + 1) * bs, request.num_tokens - 1))
        key = kv.parent_key(request, j)
        best = max((common_prefix(t, tokens) for w in steps for t in w.get(key, ())), default=0)
        return j * bs + best - 1 > num_reusable

    def _note_in_flight(self, request: Request, num_new: int) -> None:
        """Remember the tokens of the blocks this step writes for `request`."""
        kv, bs = self.kv_cache_manager, self.kv_cache_manager.block_size
        start, end = request.num_computed_tokens - num_new, min(request.num_computed_tokens, request.num_tokens)
        for j in range(start // bs, -(-end // bs)):
            tokens = request.cache_token_ids(j * bs, min((j + 1) * bs, end))
            self._in_flight.setdefault(kv.parent_key(request, j), []).append(tokens)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str]):
        """Slots for `request`, preempting from the tail of `running` until they fit.
        None if `request` itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            if request in self._preempt_tail(preempted):
                return None

    def _preempt_tail(self, preempted: set[str]) -> list[Request]:
        """Preempt the tail of `running`: its last request, or the whole beam group it
        belongs to (a group's running beams are contiguous, and recomputed together).
        Returns the preempted requests."""
        if self.policy == "priority":  # the last of (priority, arrival) order, with its beam group
            last = max(self.running, key=lambda r: (r.priority, r.arrival))
            victims = [r for r in reversed(self.running) if r is last or (last.beam is not None and r.beam is last.beam)]
            self.running = [r for r in self.running if r not in victims]
        else:
            victims = [self.running.pop()]
            group = victims[0].beam
            while group is not None and self.running and self.running[-1].beam is group:
                victims.append(self.running.pop())
        for victim in victims:  # the last first: the group keeps its order at the head of the queue
            self._preempt(victim)
            preempted.add(victim.request_id)
        return victims

    # ------------------------------------------------------------- beam search

    def _seats_taken(self) -> int:
        """Sequences the running batch holds: one per request, and a beam search's width
        from the moment its prompt runs (its beams fork later)."""
        if not self.beam_groups:
            return len(self.running)
        groups = {id(r.beam): r.beam.width for r in self.running if r.beam is not None}
        return sum(r.beam is None for r in self.running) + sum(groups.values())

    def _seats_needed(self, request: Request) -> int:
        """Seats admitting `request` takes: one, a beam search's width, none for a beam
        of a group that runs already (its seats are taken)."""
        if request.beam is None:
            return 1
        return 0 if any(r.beam is request.beam for r in self.running) else request.beam.width

    def _beams_fit(self, request: Request) -> bool:
        """Whether the request at the head of the queue may be admitted as far as its
        beams go: a preempted group's beams (contiguous at the head) must fit the free
        blocks all together, so none waits holding blocks for another that cannot come."""
        group = request.beam
        if group is None or not request.num_output_tokens:
            return True
        kv = self.kv_cache_manager
        members = list(itertools.takewhile(lambda r: r.beam is group, self.waiting))
        needed = sum(-(-r.num_tokens // kv.block_size) for r in members) * kv.num_groups
        return needed <= kv.num_free_blocks

    def _room_for_beams(self, group: BeamGroup, start: int, budget: int, preempted: set[str]) -> bool:
        """Before scheduling the first of a group's running beams (contiguous from
        `running[start]`): preempt from the tail until the pool holds every scheduled
        beam's new blocks, so none of them is preempted after another was scheduled.
        False if the group itself was preempted."""
        kv = self.kv_cache_manager
        needed = 0
        for beam in itertools.takewhile(lambda r: r.beam is group, self.running[start:]):
            if not group.waits(beam) and budget > 0:
                num_new = min(beam.num_tokens - beam.num_computed_tokens, budget)
                needed += kv.num_blocks_needed(beam, num_new)
                budget -= num_new
        while needed > kv.num_free_blocks:
            if self._preempt_tail(preempted)[0].beam is group:
                return False
        return True

    def _drop_beam(self, beam: Request) -> None:
        """A beam no candidate continues (or of a finished or aborted group): its blocks
        go back, the runner forgets it."""
        if beam.status is RequestStatus.RUNNING:
            self.running.remove(beam)
        elif beam in self.waiting:
            self.waiting.remove(beam)
        self._fork_copies.pop(beam.request_id, None)
        self._finish(beam, FinishReason.ABORT)

    def _decide_beams(self, group: BeamGroup) -> EngineCoreOutput | None:
        """Every live beam of `group` has reported: keep the best continuations (forking
        beams), or finish the search (its output)."""
        choices = group.decide(self.max_model_len)
        if choices:
            self._continue_beams(group, choices)
            return None
        for beam in list(group.beams):
            self._drop_beam(beam)
        del self.beam_groups[group.request_id]
        best = group.finished[0]
        return EngineCoreOutput(group.request_id, [], finish_reason=best.finish_reason, stop_reason=best.stop_reason,
                                num_cached_tokens=max(group.num_cached_tokens, 0), beams=group.result(),
                                queue_seconds=group.seed.queue_seconds)

    def _continue_beams(self, group: BeamGroup, choices: list[Choice]) -> None:
        """The group's next beams: a parent's first child continues as the parent itself
        (the chosen token replaces its sampled one); a further child is a fork sharing
        the parent's full blocks, with a copy of its partial last one. Beams no child
        continues are dropped. When the pool cannot hold the forks' copies the whole
        group is preempted (recomputed later; the prefix cache keeps what it shares)."""
        kv, old = self.kv_cache_manager, group.beams
        start = self.running.index(old[0])
        continued: set[str] = set()
        beams: list[tuple[Request, Choice, bool]] = []  # (beam, its choice, forked)
        for choice in choices:
            parent = choice.parent
            if parent.request_id in continued:
                child = dataclasses.replace(
                    parent, request_id=group.next_beam_id(), output_token_ids=list(parent.output_token_ids),
                    block_hashes=list(parent.block_hashes), spec_token_ids=[], chosen_token=None)
                self.requests[child.request_id] = child
                beams.append((child, choice, True))
            else:
                continued.add(parent.request_id)
                beams.append((parent, choice, False))
        for beam in old:
            if beam.request_id not in continued:
                self._drop_beam(beam)
        fits = sum(kv.fork_blocks_needed(c.parent) for _, c, forked in beams if forked) <= kv.num_free_blocks
        for beam, choice, forked in beams:
            if forked and fits:
                self._fork_copies[beam.request_id] = kv.fork(choice.parent, beam)
                beam.new_to_runner = True
        for beam, choice, forked in beams:
            beam.append_output_token_ids(choice.token)
            beam.chosen_token = None if forked else choice.token
            if not forked:
                self.running.remove(beam)
        group.beams = [beam for beam, _, _ in beams]
        group.cum_logprobs = {beam.request_id: choice.cum_logprob for beam, choice, _ in beams}
        start = min(start, len(self.running))
        self.running[start:start] = group.beams
        if not fits:
            for beam in reversed(group.beams):  # the last first: the group keeps its order at the head
                self.running.remove(beam)
                self._preempt(beam)  # a fork holds no blocks yet: it only resets
                self.finished_req_ids.add(beam.request_id)  # the runner drops what it holds of it

    # ---------------------------------------------------------------- images

    def _fit_images(self, request: Request, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the step can compute: every image
        they reach must be encoded (in the encoder cache, or encoded this step while
        the step's image budget and a slot allow); they stop before the first that
        cannot be."""
        end = start + num_new
        for image in request.images:
            if not image.overlaps(start, end):
                continue
            whole = image.offset + image.length <= end and self._images_in_step < self.max_images_per_step
            if (self.whole_images and not whole) or self._image_slot(request, image) is None:
                return max(0, image.offset - start)
            self._images_in_step += 1
        return num_new

    def _image_slot(self, request: Request, image) -> int | None:
        """The image's encoder cache slot, held by `request`: found, or allocated to be
        encoded this step; None when neither can be."""
        cache, rid = self.encoder_cache, request.request_id
        held = rid in cache.holders.get(image.mm_hash, ())
        slot = cache.lookup(image.mm_hash, rid)
        if not held:
            cache.count_lookup(hit=slot is not None)
        if slot is not None:
            return slot
        if len(self._encoder_inputs) >= self.max_images_per_step or not cache.can_allocate():
            return None
        slot = cache.allocate(image.mm_hash, rid)
        self._encoder_inputs.append(EncoderInput(slot, image))
        return slot

    def _note_images(self, request: Request, start: int, num_new: int) -> None:
        """The step's images of `request` for the runner; those its tokens finish are
        let go once the step is scheduled (their K/V hold them from then on)."""
        for image in request.images:
            if image.overlaps(start, start + num_new):
                slot = self.encoder_cache.slot_of[image.mm_hash]
                self._image_slots.setdefault(request.request_id, []).append((image.offset, image.length, slot))
                if image.offset + image.length <= start + num_new:
                    self._image_releases.append((image.mm_hash, request.request_id))

    def _end_image_step(self) -> tuple[list[EncoderInput], dict[str, list[tuple[int, int, int]]]]:
        """This step's images to encode and image slots by request; the images it
        finishes let go (a later step's allocation may reuse their slots: the device
        runs this step first)."""
        if self.encoder_cache is None:
            return [], {}
        for mm_hash, rid in self._image_releases:
            self.encoder_cache.release(mm_hash, rid)
        out = self._encoder_inputs, self._image_slots
        self._encoder_inputs, self._image_slots, self._image_releases, self._images_in_step = [], {}, [], 0
        return out

    def _encoder_stats(self) -> dict[str, int]:
        if self.encoder_cache is None:
            return {}
        stats = self.encoder_cache.stats
        return dict(encoder_cache_queries=stats.queries, encoder_cache_hits=stats.hits, images_encoded=stats.encoded)

    def _release_images(self, request: Request) -> None:
        for image in request.images:
            self.encoder_cache.release(image.mm_hash, request.request_id)

    def _advance(self, request: Request, num_new: int, num_scheduled: dict[str, int]) -> None:
        """Count this step's tokens as computed now (the step always runs before the
        next schedule) and enter blocks they fill into the prefix cache, so a request
        admitted later in this same step can already share them: the forward writes
        every token's K/V before any attention reads the cache."""
        num_scheduled[request.request_id] = num_new
        if request.images:
            self._note_images(request, request.num_computed_tokens, num_new)
        request.num_computed_tokens += num_new
        # draft tokens (past num_tokens) are not known to be the request's: no block holding one is cached
        self._cached_this_step += self.kv_cache_manager.cache_blocks(
            request, min(request.num_computed_tokens, request.num_tokens))
        if self._in_flight is not None:
            self._note_in_flight(request, num_new)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._release_images(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if request.beam is not None:  # it samples again once recomputed; the runner gets it whole
            request.beam.reported.pop(request.request_id, None)
            request.new_to_runner, request.chosen_token = False, None
            self._fork_copies.pop(request.request_id, None)
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)
        logger.warning(
            "preempted request %s (recompute; %d tokens; %d preemptions so far)",
            request.request_id, request.num_tokens, self.num_preemptions,
        )

    def fail_step(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """The step of `sched` failed: the blocks it entered into the prefix cache hold
        no KV, so they leave the cache, and its requests (whose progress it counted)
        are aborted. Returns their outputs."""
        self._unrecorded.pop(id(sched), None)
        self.kv_cache_manager.uncache(self._cached_this_step)
        self._cached_this_step = []
        return self.abort_requests(list(sched.num_scheduled_tokens))

    # ------------------------------------------------------------------- update

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append the tokens each request gained (checking stop conditions after each),
        take back the K/V of rejected draft tokens, free finished requests, and keep the
        drafts proposed for the next step."""
        outputs, self._grammar_failures = self._grammar_failures, []
        self._unrecorded.pop(id(sched), None)
        starts = {r.req_id: r.num_computed_tokens for r in (*sched.scheduled_new_reqs, *sched.scheduled_cached_reqs)}
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran (or finished by the step before it)
                continue
            steps = sched.decode_steps.get(req_id, 1)
            if tokens and request.num_output_placeholders:  # async scheduling: the tokens in flight came
                request.num_output_placeholders = max(0, request.num_output_placeholders - steps)
            num_computed = sched.num_scheduled_tokens[req_id] - self._reject_drafts(
                request, sched.scheduled_spec_decode_tokens.get(req_id), tokens)
            if request.beam is not None:
                self._record_contents(request, num_computed, starts[req_id] + num_computed)
                if tokens:  # it sampled: its candidates, the group decides once all are in
                    request.beam.report(request, *result.beam_candidates[req_id])
                    if request.beam.ready and (output := self._decide_beams(request.beam)) is not None:
                        outputs.append(output)
                continue
            if req_id in result.pooled:  # a pooling request: done in the step that computed it
                self.running.remove(request)
                self._finish(request, FinishReason.STOP)
                outputs.append(dataclasses.replace(self._output(request, [], None), pooled=result.pooled[req_id]))
                continue
            prompt_logprobs = self._update_prompt_scores(request, result.prompt_logprobs.get(req_id))
            if not tokens or request.max_tokens == 0:
                self._record_contents(request, num_computed, starts[req_id] + num_computed)
                if request.max_tokens == 0 and tokens:  # scoring the prompt only: the sample is dropped
                    self.running.remove(request)
                    self._finish(request, FinishReason.LENGTH)
                    outputs.append(self._output(request, [], None, prompt_logprobs))
                elif prompt_logprobs is not None:
                    outputs.append(self._output(request, [], None, prompt_logprobs))
                continue
            new_tokens, finish, stop_reason = self._append_tokens(request, tokens)
            if steps > 1:  # a decode loop: the K/V of each token it kept but the last
                num_computed = len(new_tokens)
                if finish is None:  # (it ran all its steps unless it stopped)
                    request.num_computed_tokens -= steps - len(tokens)
            running = request.status is RequestStatus.RUNNING  # else preempted after the step was dispatched
            if running:
                self._record_contents(request, num_computed, starts[req_id] + num_computed)
            if finish is not None:
                (self.running if running else self.waiting).remove(request)
                self._finish(request, finish, stop_reason)
            else:
                request.spec_token_ids = self._usable_drafts(request, result.spec_token_ids.get(req_id))
            logprobs = result.logprobs.get(req_id)
            logprobs = None if logprobs is None else logprobs.first(len(new_tokens))
            outputs.append(self._output(request, new_tokens, logprobs, prompt_logprobs))
        step_tokens = sched.total_num_scheduled_tokens + sum(sched.decode_steps.values()) - len(sched.decode_steps)
        return EngineCoreOutputs(outputs=outputs, stats=self.make_stats(), step_tokens=step_tokens)

    def _reject_drafts(self, request: Request, drafts: list[int] | None, tokens: list[int]) -> int:
        """The draft tokens the step computed for `request` past those it accepted (the
        target's tokens agree with the first len(tokens) - 1): no longer counted as
        computed (their K/V is overwritten later). Returns how many."""
        if not drafts or not tokens:
            return 0
        num_accepted = len(tokens) - 1
        self.spec_stats = self.spec_stats.observe(len(drafts), num_accepted)
        request.num_computed_tokens -= len(drafts) - num_accepted
        return len(drafts) - num_accepted

    def _append_tokens(self, request: Request, tokens: list[int]
                       ) -> tuple[list[int], FinishReason | None, int | str | None]:
        """Append `tokens` one by one until one finishes the request (the rest are
        dropped). Returns those appended, and the finish reason and stop reason."""
        for i, token in enumerate(tokens):
            request.append_output_token_ids(token)
            finish, stop_reason = self._check_stop(request, token)
            if finish is not None:
                return tokens[:i + 1], finish, stop_reason
        return tokens, None, None

    def _record_contents(self, request: Request, num_computed: int, end: int) -> None:
        """Record what the blocks hold that a step wrote for `request` (its `num_computed`
        tokens before `end`)."""
        scores = request.prompt_scores
        self.kv_cache_manager.record_contents(request, num_computed, None if scores is None else scores.rows,
                                              -1 if scores is None else scores.k, end)

    def _usable_drafts(self, request: Request, drafts: list[int] | None) -> list[int]:
        """The proposed drafts the request may compute next step: under a grammar, those
        it would accept in turn (each position is then sampled under the grammar's mask
        after the drafts before it: `constrained_rows`); none while min_tokens holds
        back stop tokens; never more than would pass max_tokens (so the K/V of a step
        stays within what `check_fits` admitted)."""
        if not drafts or request.num_output_tokens < request.sampling_params.min_tokens:
            return []
        drafts = drafts[:max(0, request.max_kv_tokens - request.num_tokens)]
        if request.structured is not None and drafts:
            drafts = drafts[:request.structured.grammar.valid_prefix(drafts)]
        return drafts

    def _update_prompt_scores(self, request: Request, new_rows: LogprobsLists | None) -> LogprobsLists | None:
        """Take this step's prompt logprob rows; the rows due in the request's output
        (with any filled from the cache at admission)."""
        scores = request.prompt_scores
        if scores is None:
            return None
        if new_rows is not None:
            scores.extend(new_rows)
        return scores.take_unsent()

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | str | None]:
        params = request.sampling_params
        if request.structured is not None and not request.structured.grammar.accept_token(token):
            # the mask allowed only what the grammar accepts: a bug, or a stop token held back
            # by min_tokens where the grammar allowed nothing else
            logger.error("request %s: token %d is not allowed by its grammar", request.request_id, token)
            return FinishReason.ABORT, "grammar"
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return FinishReason.STOP, None
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache_manager.free(request)
        self._release_images(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    @staticmethod
    def _output(request: Request, new_token_ids, logprobs, prompt_logprobs=None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queue_seconds=request.queue_seconds,
        )

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_blocks_used=kv.num_used_blocks,
            num_tokens_held=kv.num_tokens_held(self.running),
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            **self._encoder_stats(),
            num_preemptions=self.num_preemptions,
            spec_decoding=self.spec_stats,
            running_lora_adapters=_adapter_names(self.running),
            waiting_lora_adapters=_adapter_names(self.waiting),
        )

