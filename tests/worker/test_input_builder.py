"""The runner's input building on its own (jaxllm.worker.input_builder): numpy from the
rows' host state, nothing compiled. Token positions, KV slots, query offsets and sample
rows of a mixed step, a multi-step decode call's limits, and the persistent rows
against a from-scratch build over random schedules."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm import SamplingParams
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.core.scheduler import Scheduler
from jaxllm.kv_cache_groups import kv_cache_groups
from jaxllm.messages import EngineCoreRequest, ModelRunnerOutput
from jaxllm.worker.buckets import StepShape, StepShapes
from jaxllm.worker.decode_loop import LoopInputs
from jaxllm.worker.input_batch import STOP_WIDTH, InputBatch
from jaxllm.worker.input_builder import InputBuilder
from jaxllm.worker.step import StepInputs

BLOCK = 4


def _builder(decode_steps: int = 1) -> InputBuilder:
    batch = InputBatch(4, 64, 16)
    return InputBuilder(batch, StepShapes.make(32, 4, decode_steps=decode_steps), kv_cache_groups([None, None]),
                        block_size=BLOCK, max_model_len=64, async_scheduling=False, with_lora=False,
                        bitmask_width=2, num_scheduler_steps=decode_steps)


def _new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0, **params) -> NewRequestData:
    return NewRequestData(req_id, tokens, len(tokens), SamplingParams(**params), seed=1, eos_token_id=2,
                          block_ids=(blocks,), num_computed_tokens=computed)


def _sched(new=(), cached=(), tokens=None, decode_steps=None) -> SchedulerOutput:
    return SchedulerOutput(list(new), list(cached), tokens, sum(tokens.values()), set(), set(),
                           decode_steps=decode_steps or {})


def test_a_prompt_chunk_and_a_decode():
    b = _builder()
    # "a": a 6-token prompt, 4 computed (a prefix hit), its last 2 this step; "b": decoding at position 5
    a = _new("a", [3, 4, 5, 6, 7, 8], [1, 2], computed=4)
    b.input_batch.add_request(_new("b", [10, 11, 12, 13, 14, 15], [7, 8], computed=5))
    b.input_batch.add_request(a)  # (the runner adds a step's new requests before preparing it)
    step = b.prepare_step(_sched([a], [], {"b": 1, "a": 2}))
    host = step.host
    np.testing.assert_array_equal(host.positions, [5, 4, 5])
    np.testing.assert_array_equal(host.qsl, [0, 1, 3])
    np.testing.assert_array_equal(host.seq_lens, [6, 6])
    np.testing.assert_array_equal(host.slots[0], [8 * BLOCK + 1, 2 * BLOCK + 0, 2 * BLOCK + 1])
    np.testing.assert_array_equal(host.input_ids, [15, 7, 8])
    np.testing.assert_array_equal(host.logit_rows, [0, 2])  # each row's last token
    assert step.shape == StepShape(4, 4, 4) and isinstance(step.inputs, StepInputs)
    assert step.inputs.input_ids.shape == (4,) and step.inputs.attn.block_tables.shape == (4, 16)


def test_a_decode_loop_carries_its_limits():
    b = _builder(decode_steps=4)
    for i, stops in enumerate(([], list(range(100, 100 + STOP_WIDTH + 3)))):
        b.input_batch.add_request(_new(f"r{i}", [3, 4, 5, 6, 7], [1 + 2 * i, 2 + 2 * i], computed=4,
                                       stop_token_ids=stops, min_tokens=3 * i))
    step = b.prepare_step(_sched([], [CachedRequestData("r0", ([],), 4), CachedRequestData("r1", ([],), 4)],
                                 {"r0": 1, "r1": 1}, decode_steps={"r0": 4, "r1": 2}))
    assert step.shape == StepShape(4, 4, 4, 4) and isinstance(step.inputs, LoopInputs)
    limits = step.inputs.limits
    np.testing.assert_array_equal(limits.max_steps, [4, 2, 0, 0])
    np.testing.assert_array_equal(limits.min_tokens, [0, 3, 0, 0])
    assert limits.num_steps == 4
    assert limits.stop_token_ids[0].tolist() == [2] + [-1] * (STOP_WIDTH - 1)  # EOS
    assert limits.stop_token_ids[1].tolist() == [2] + list(range(100, 100 + STOP_WIDTH - 1))  # EOS, then the first


def _fresh_batch(scheduler: Scheduler, sched: SchedulerOutput, decode_steps: int) -> InputBuilder:
    """A builder whose rows are made from scratch for `sched`: each scheduled request's
    whole state as the scheduler holds it, in schedule order."""
    builder = _builder(decode_steps)
    before = {r.req_id: r.num_computed_tokens for r in (*sched.scheduled_new_reqs, *sched.scheduled_cached_reqs)}
    for req_id in sched.num_scheduled_tokens:
        r = scheduler.requests[req_id]
        builder.input_batch.add_request(NewRequestData(
            req_id, r.all_token_ids, r.num_prompt_tokens, r.sampling_params, r.seed, r.eos_token_id,
            scheduler.kv_cache_manager.group_block_ids(req_id), before[req_id]))
    return builder


def _comparable(step) -> dict[str, np.ndarray]:
    """A prepared step's arrays, but those naming rows (which differ between batches)."""
    leaves = jax.tree_util.tree_flatten_with_path((step.inputs, dataclasses.asdict(step.host)))[0]
    named = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}
    return {k: v for k, v in named.items() if "history_rows" not in k and k not in ("[1]['rows']", "[1]['tok_rows']")}


def _random_request(rng, i: int) -> Request:
    max_tokens = int(rng.integers(1, 12))
    params = dict(max_tokens=max_tokens, min_tokens=int(rng.integers(0, min(max_tokens, 3) + 1)),
                  stop_token_ids=rng.integers(3, 40, int(rng.integers(0, 3))).tolist(),
                  temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])),
                  presence_penalty=float(rng.choice([0.0, 0.5])), logprobs=rng.choice([None, 2]),
                  logit_bias={int(t): 1.5 for t in rng.integers(3, 40, int(rng.integers(0, 2)))})
    prompt = rng.integers(3, 40, int(rng.integers(1, 20))).tolist()
    req = EngineCoreRequest(f"r{i}", prompt, SamplingParams(**params), 2, 0.0)
    return Request.from_engine_core_request(req, params["max_tokens"], int(rng.integers(0, 2**40)))


@pytest.mark.parametrize("decode_steps", [1, 4])
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_rows_kept_across_steps_build_what_a_fresh_batch_builds(decode_steps, seed):
    """The runner's rows persist across steps and change by the schedule's diffs
    (`InputBatch.update`, then each step's tokens recorded). Over random schedules of a
    real scheduler (admissions, chunked prompts, prefix hits, preemption in a 12-block
    pool, aborts, finishes on stop tokens and max_tokens, multi-step decode), every
    step's inputs equal those built from scratch from the scheduler's requests, and
    each row holds its request's tokens."""
    rng = np.random.default_rng(seed)
    scheduler = Scheduler(KVCacheManager(12, BLOCK, enable_caching=True), max_num_seqs=4,
                          max_num_batched_tokens=16, max_model_len=64, num_scheduler_steps=decode_steps)
    kept = _builder(decode_steps)
    batch = kept.input_batch
    for i in range(80):
        if i < 50 and rng.random() < 0.3:
            scheduler.add_request(_random_request(rng, i))
        if scheduler.running and rng.random() < 0.05:
            scheduler.abort_requests([scheduler.running[int(rng.integers(len(scheduler.running)))].request_id])
        sched = scheduler.schedule()
        batch.update(sched)
        if not sched.num_scheduled_tokens:
            continue
        step = kept.prepare_step(sched)
        want = _comparable(_fresh_batch(scheduler, sched, decode_steps).prepare_step(sched))
        got = _comparable(step)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        host, ids = step.host, rng.integers(2, 40, (decode_steps, len(step.host.rows))).astype(np.int32)
        if host.decode_steps is None:
            batch.record_step(host.rows, host.samples, host.seq_lens, np.ones(len(host.rows), np.int32),
                              ids[0][host.samples])
            tokens = [[int(t)] if ok else [] for t, ok in zip(ids[0], host.samples)]
        else:
            batch.record_loop(host.rows, host.seq_lens, ids, host.decode_steps)
            tokens = [ids[:n, j].tolist() for j, n in enumerate(host.decode_steps)]
        scheduler.update_from_output(sched, ModelRunnerOutput(step.req_ids, tokens))
        for req_id, row in zip(step.req_ids, host.rows):
            request = scheduler.requests.get(req_id)
            if request is not None and request.status != RequestStatus.FINISHED:  # (a stop token ends it early)
                np.testing.assert_array_equal(batch.token_ids[row, :batch.num_tokens[row]], request.all_token_ids)
