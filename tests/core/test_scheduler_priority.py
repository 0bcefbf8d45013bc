"""The priority scheduling policy (vLLM's --scheduling-policy priority): the waiting
queue by (priority, arrival), preemption of the last of that order; FCFS unchanged."""

import pytest

from jaxllm import SamplingParams
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.messages import EngineCoreRequest, ModelRunnerOutput


def request(name: str, priority: int = 0, prompt_len: int = 8) -> Request:
    req = EngineCoreRequest(name, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4), 2, 0.0,
                            priority=priority)
    return Request.from_engine_core_request(req, 4, 0)


def step(s: Scheduler) -> None:
    """One scheduled step and its outputs: every request that samples gains token 7."""
    sched = s.schedule()
    ids = list(sched.num_scheduled_tokens)
    s.update_from_output(sched, ModelRunnerOutput(ids, [[7] if s.requests[i].num_computed_tokens
                                                        >= len(s.requests[i].prompt_token_ids) else []
                                                        for i in ids]))


def scheduler(policy: str, num_blocks: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                     policy=policy)


def test_an_interactive_request_overtakes_the_batch_queue():
    s = scheduler("priority")
    for i in range(6):
        s.add_request(request(f"batch{i}", priority=10))
    step(s)
    assert [r.request_id for r in s.running] == ["batch0", "batch1"]  # the seats are full
    s.add_request(request("interactive", priority=0))
    s.add_request(request("batch6", priority=10))
    s.add_request(request("urgent-too", priority=0))
    assert [r.request_id for r in s.waiting] == ["interactive", "urgent-too", "batch2", "batch3", "batch4",
                                                 "batch5", "batch6"]
    s.abort_requests(["batch0"])  # a seat frees: the interactive request takes it, not batch2
    step(s)
    assert [r.request_id for r in s.running] == ["batch1", "interactive"]


def test_fcfs_keeps_arrival_order():
    s = scheduler("fcfs")
    for name in ("a", "b", "c"):
        s.add_request(request(name))
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high-late")])
def test_preemption_takes_the_last_of_the_policy_s_order(policy, victim):
    """Two running requests, the low-priority one admitted first: the priority policy
    preempts it (and it goes back to its place in the queue); FCFS preempts the most
    recently admitted."""
    s = scheduler(policy)
    s.add_request(request("low", priority=5 if policy == "priority" else 0))
    step(s)
    s.add_request(request("high-late", priority=0))
    step(s)
    assert [r.request_id for r in s.running] == ["low", "high-late"]
    (preempted,) = s._preempt_tail(set())
    assert preempted.request_id == victim and s.waiting[0].request_id == victim
