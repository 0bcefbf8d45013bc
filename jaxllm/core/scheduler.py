"""The continuous-batching scheduler (vLLM v1 style: no prefill and decode phases).

Every request has num_computed_tokens and a target (all its tokens); each step hands
out tokens under a budget (max_num_batched_tokens) and a cap on running sequences
(max_num_seqs): running requests first, in admission order, then waiting ones (FCFS).
A long prompt is computed in chunks over several steps, mixed with decodes in the same
ragged batch. When the KV cache cannot give a running request its slots, the most
recently admitted running request is preempted: its blocks are freed and it goes back
to the head of the waiting queue, to be recomputed later (its prefix may still hit
the prefix cache).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.prompt_scores import PromptScoresCache
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from jaxllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, LogprobsLists, SchedulerStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the tail is preempted first
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        self.num_preemptions = 0
        # prompt logprobs of prefix-cached blocks, so scoring a cached prefix skips it
        self.prompt_scores_cache = (
            PromptScoresCache(kv_cache_manager.block_size, kv_cache_manager.num_usable_blocks)
            if kv_cache_manager.enable_caching else None
        )
        self._scored_this_step: set = set()  # blocks whose prompt rows the step being scheduled completes
        self._cached_this_step: list = []  # blocks the last schedule() entered into the prefix cache

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never fit in the KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.kv_cache_manager.check_fits(request, request.max_kv_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
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

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ----------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        self._cached_this_step = []
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self._allocate_or_preempt(request, num_new, preempted)
            if new_blocks is None:  # the request itself was preempted (it was the tail)
                break
            cached_reqs.append(
                CachedRequestData(request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens)
            )
            self._advance(request, num_new, num_scheduled)
            budget -= num_new
            i += 1

        # No admissions in a step that had to preempt: the pool is under pressure.
        deferred: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._scores_come_this_step(request):
                deferred.append(self.waiting.popleft())
                continue
            admitted = self._admit(request, budget, num_scheduled)
            if admitted is None:
                break
            new_reqs.append(admitted)
            budget -= num_scheduled[request.request_id]
        self.waiting.extendleft(reversed(deferred))
        self._scored_this_step.clear()

        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )

    def _admit(self, request: Request, budget: int, num_scheduled: dict[str, int]) -> NewRequestData | None:
        """Take the head of the waiting queue into the running batch with its prefix-cache
        hits and slots for its first chunk; None if the pool cannot hold that chunk."""
        kv = self.kv_cache_manager
        hits, num_hit_tokens = kv.get_computed_blocks(request, self._usable_hits(request))
        num_new = min(request.num_tokens - num_hit_tokens, budget)
        if kv.allocate_slots(request, num_new, num_hit_tokens, hits) is None:
            return None
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        scores = request.prompt_scores
        if scores is not None and self.prompt_scores_cache is not None:
            self.prompt_scores_cache.fill(scores, request.num_prompt_tokens, request.block_hashes, num_hit_tokens)
        new = NewRequestData(
            req_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            seed=request.seed,
            eos_token_id=request.eos_token_id,
            block_ids=kv.get_block_ids(request.request_id),
            num_computed_tokens=num_hit_tokens,
            num_prompt_scored=0 if scores is None else len(scores.rows),
        )
        self._advance(request, num_new, num_scheduled)
        return new

    def _scores_come_this_step(self, request: Request) -> bool:
        """Whether a request scoring its prompt should wait a step: a request scheduled
        in this step scores some of its prompt's blocks, whose rows (and KV) it can take
        from the cache in the next step instead of computing them again (lm-eval sends
        the choices of one question together)."""
        if request.prompt_scores is None or not self._scored_this_step:
            return False
        hashes = self._prompt_block_hashes(request)
        # skipping blocks 0..u-1 needs the rows of block u, a full block too: with fewer
        # than two full blocks nothing can be skipped, and waiting gains nothing
        return len(hashes) >= 2 and any(h in self._scored_this_step for h in hashes)

    def _prompt_block_hashes(self, request: Request) -> list:
        """The hashes of the full blocks of the request's prompt (computed once, kept on
        the request)."""
        kv = self.kv_cache_manager
        return kv.block_hashes(request, request.num_prompt_tokens // kv.block_size)

    def _note_scored_blocks(self, request: Request) -> None:
        """Remember the blocks whose prompt rows this step's part of `request` completes."""
        scores = request.prompt_scores
        if scores is None or self.prompt_scores_cache is None:
            return
        kv = self.kv_cache_manager
        rows_after = min(request.num_computed_tokens, request.num_prompt_tokens - 1)
        num_blocks = min((rows_after + 1) // kv.block_size, request.num_prompt_tokens // kv.block_size)
        hashes = kv.block_hashes(request, num_blocks)
        self._scored_this_step.update(hashes[scores.num_recorded_blocks:num_blocks])

    def _usable_hits(self, request: Request) -> Callable[[int], int] | None:
        """For a request scoring its prompt: how many prefix-cache hit blocks it can
        skip (those whose prompt logprobs are cached too)."""
        scores = request.prompt_scores
        if scores is None:
            return None
        if self.prompt_scores_cache is None:
            return lambda num_hit_blocks: 0
        cache, hashes = self.prompt_scores_cache, self._prompt_block_hashes(request)
        return lambda num_hit_blocks: cache.usable_hits(scores, request.num_prompt_tokens, hashes, num_hit_blocks)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str]):
        """Slots for `request`, preempting from the tail of `running` until they fit.
        None if `request` itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _advance(self, request: Request, num_new: int, num_scheduled: dict[str, int]) -> None:
        """Count this step's tokens as computed now (the step always runs before the
        next schedule) and enter blocks they fill into the prefix cache, so a request
        admitted later in this same step can already share them: the forward writes
        every token's K/V before any attention reads the cache."""
        num_scheduled[request.request_id] = num_new
        request.num_computed_tokens += num_new
        self._cached_this_step += self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self._note_scored_blocks(request)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.warning(
            "preempted request %s (recompute; %d tokens; %d preemptions so far)",
            request.request_id, request.num_tokens, self.num_preemptions,
        )

    def fail_step(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """The step of `sched` failed: the blocks it entered into the prefix cache hold
        no KV, so they leave the cache, and its requests (whose progress it counted)
        are aborted. Returns their outputs."""
        self.kv_cache_manager.uncache(self._cached_this_step)
        self._cached_this_step = []
        return self.abort_requests(list(sched.num_scheduled_tokens))

    # ------------------------------------------------------------------- update

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, check stop conditions, free finished requests."""
        outputs = []
        for req_id, token in zip(result.req_ids, result.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            prompt_logprobs = self._update_prompt_scores(request, result.prompt_logprobs.get(req_id))
            if token is None:
                if prompt_logprobs is not None:
                    outputs.append(self._output(request, [], None, prompt_logprobs))
                continue
            if request.max_tokens == 0:  # scoring the prompt only: the sample is dropped
                self.running.remove(request)
                self._finish(request, FinishReason.LENGTH)
                outputs.append(self._output(request, [], None, prompt_logprobs))
                continue
            request.append_output_token_ids(token)
            finish, stop_reason = self._check_stop(request, token)
            if finish is not None:
                self.running.remove(request)
                self._finish(request, finish, stop_reason)
            outputs.append(self._output(request, [token], result.logprobs.get(req_id), prompt_logprobs))
        return EngineCoreOutputs(outputs=outputs, stats=self.make_stats())

    def _update_prompt_scores(self, request: Request, new_rows: LogprobsLists | None) -> LogprobsLists | None:
        """Take this step's prompt logprob rows; the rows due in the request's output
        (with any filled from the cache at admission)."""
        scores = request.prompt_scores
        if scores is None:
            return None
        if new_rows is not None:
            scores.extend(new_rows)
            if self.prompt_scores_cache is not None:
                kv = self.kv_cache_manager
                hashes = kv.block_hashes(request, (len(scores.rows) + 1) // kv.block_size)
                self.prompt_scores_cache.record(scores, hashes)
        return scores.take_unsent()

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
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
            num_preemptions=self.num_preemptions,
        )
