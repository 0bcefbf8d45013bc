"""The draft-model proposer: a smaller model with the target's vocabulary drafts k
tokens per request, greedily, after each target step.

It runs on the model runner machinery of its own: a ModelRunner for the draft model
(its own buckets, compiled at start-up; its own KV cache) and a KVCacheManager over
that cache, both private to the proposer, so the target's scheduler never sees them.
After each target step it brings every request the target holds up to date (the
positions it has not computed yet: a prefill chunk, the tokens a verification
accepted, the target's token), in chunks within its token budget; a request it has
caught up with is drafted: the first pass samples the draft's next token at the
request's last position, then k - 1 one-token passes feed each draft back. Its draft
positions' K/V are recomputed from the real tokens next time (it rewinds to them),
so nothing it reads was computed from a rejected draft. A request it cannot hold
(its pool is short) is simply not drafted: proposals are only ever a speed-up.

Greedy drafts are a deterministic proposal, so the target's verification (sample at
every position, accept while equal: jaxllm.worker.model_runner) keeps the target's
output distribution exactly.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class Tokens(Protocol):
    """What the proposer reads of the target's rows (jaxllm.worker.input_batch.InputBatch)."""

    row_of: dict[str, int]
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray


class DraftModelProposer:
    """Attributes:
        runner: the draft model's ModelRunner (its own KV cache).
        manager: the blocks of that cache, per request.
        k: tokens drafted per request.
        budget: the most tokens one catch-up pass computes.
    """

    def __init__(self, runner, manager: KVCacheManager, k: int, budget: int) -> None:
        self.runner, self.manager, self.k, self.budget = runner, manager, k, budget
        self.requests: dict[str, Request] = {}  # the drafter's own record: blocks and computed positions

    def propose_batch(self, batch: Tokens, gained: list[str], max_model_len: int) -> dict[str, list[int]]:
        """Draft tokens for the requests in `gained` (those whose last step gave them
        tokens) that the draft has caught up with; every request `batch` holds is
        brought closer to its known tokens."""
        sched, drafting = self._catch_up(batch, set(gained), max_model_len)
        if sched.is_empty:
            return {}
        out = self.runner.execute_model(sched)
        drafts = {r: [t[0]] for r, t in zip(out.req_ids, out.sampled_token_ids) if r in drafting and t}
        for i in range(1, max((drafting[r] for r in drafts), default=0)):  # feed each draft back
            ids = [r for r in drafts if drafting[r] > i]
            out = self.runner.execute_model(SchedulerOutput([], [CachedRequestData(r, ([],), 0) for r in ids],
                                                            dict.fromkeys(ids, 1), len(ids), set(), set()))
            for r, t in zip(out.req_ids, out.sampled_token_ids):
                drafts[r].append(t[0])
        return drafts

    def remove_requests(self, req_ids: set[str]) -> None:
        """The target let these requests go (finished, aborted, preempted): their
        blocks and rows go too."""
        gone = {r for r in req_ids if r in self.requests}
        for req_id in gone:
            self.manager.free(self.requests.pop(req_id))
        if gone:
            self.runner.execute_model(SchedulerOutput([], [], {}, 0, gone, set()))

    def _catch_up(self, batch: Tokens, gained: set[str], max_model_len: int):
        """The pass computing each request's positions the draft lacks (within the
        budget, in the batch's order), and which requests it then drafts (how many
        tokens each may take)."""
        new, cached, scheduled, drafting = [], [], {}, {}
        budget = self.budget
        for req_id, row in batch.row_of.items():
            if budget <= 0:
                break
            known = int(batch.num_tokens[row])
            request = self.requests.get(req_id)
            start = 0 if request is None else request.num_computed_tokens
            n = min(known - start, budget)
            if n <= 0:
                continue
            k = min(self.k, max_model_len - known) if start + n == known and req_id in gained else 0
            request, blocks = self._allocate(req_id, n + max(k - 1, 0))
            if blocks is None:
                continue
            tokens = batch.token_ids[row, :known]
            if start == 0:
                new.append(NewRequestData(req_id, tokens.tolist(), int(batch.num_prompt_tokens[row]), GREEDY, 0, None,
                                          (self.manager.get_block_ids(req_id),), 0))
            else:
                self.runner.rewind(req_id, start, tokens[start:])
                cached.append(CachedRequestData(req_id, ([b.block_id for b in blocks],), start))
            request.num_computed_tokens = start + n
            scheduled[req_id] = n
            budget -= n
            if k > 0:
                drafting[req_id] = k
        total = sum(scheduled.values())
        return SchedulerOutput(new, cached, scheduled, total, set(), set()), drafting

    def _allocate(self, req_id: str, num_tokens: int):
        """The request's record, and the blocks newly allocated for its next
        `num_tokens` positions (None where the pool is short: it is then not drafted,
        and a request the draft holds nothing of is forgotten)."""
        request = self.requests.get(req_id)
        if request is None:
            request = Request(req_id, prompt_token_ids=[])
        blocks = self.manager.allocate_slots(request, num_tokens)
        if blocks is not None:
            self.requests[req_id] = request
        return request, blocks
