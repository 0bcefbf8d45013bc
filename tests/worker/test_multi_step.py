"""Multi-step decode (`num_scheduler_steps`, issue 57): while every running request
decodes, one device call runs several decode steps, feeding each sampled token to the
next on the device and stopping rows there. Every output must be single steps':
tokens, finish and stop reasons exactly, logprobs to float32 rounding, synchronous and
async, under greedy, seeded, penalized, min_tokens and stop-token sampling (more stop
tokens than the device checks too), chunked prefill, prefix caching, preemption, aborts
mid-loop, structured outputs and LoRA; nothing leaks and nothing compiles after
warm-up."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.config import EngineConfig
from jaxllm.messages import EngineCoreRequest
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.worker.buckets import StepShape, loop_buckets, token_buckets
from jaxllm.worker.decode_loop import DecodeLimits, stops
from jaxllm.worker.input_batch import STOP_WIDTH
from tests.support.llm import KV_BYTES_PER_BLOCK, assert_no_leaks, make_llm
from tests.support.outputs import PROMPTS, assert_same_outputs, greedy, run_outputs, varied_params

SLOW_CASES = ("single_steps[8-",)  # (the default run's budget) K = 3 covers the path; a lone request runs K = 8


@pytest.fixture(scope="module")
def single(test_models_dir):
    """The reference: one decode step per call, synchronous."""
    return make_llm(test_models_dir, num_scheduler_steps=1, async_scheduling=False)


def _loops_ran(llm) -> bool:
    st = llm.llm_engine.core.runner.stats
    return st.num_model_steps > st.num_steps


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    """async scheduling's set, and stop tokens past what the device checks (the host stops those)."""
    many_stops = [400 + i for i in range(STOP_WIDTH + 2)] + [stop_token]  # the last beyond the device's
    return varied_params(stop_token) + [greedy(24, stop_token_ids=many_stops),
                                        SamplingParams(max_tokens=30, temperature=0.9, seed=2, min_tokens=9,
                                                       stop_token_ids=[stop_token], presence_penalty=0.4)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_steps", [3, 8])
def test_outputs_are_single_steps(test_models_dir, single, async_scheduling, num_steps):
    tokens = single.generate(PROMPTS[5], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    params = _mixed_params(stop_token=tokens[3])
    prompts = PROMPTS + [PROMPTS[5], PROMPTS[5]]
    want = run_outputs(single, prompts, params)
    assert want[5][1] == "stop" and len(want[5][0]) == 4 and want[10][:2] == want[5][:2]
    llm = make_llm(test_models_dir, num_scheduler_steps=num_steps, async_scheduling=async_scheduling)
    assert_same_outputs(run_outputs(llm, prompts, params), want)
    assert _loops_ran(llm)
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lone_request_stops_the_loop_on_the_device(test_models_dir, single, async_scheduling):
    """One request stopping at its 6th token in a loop of 8: the loop ends there (the
    device counts 6 tokens, not 8), and a prefix-cache hit afterwards reuses its blocks."""
    tokens = single.generate(PROMPTS[3], greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(test_models_dir, num_scheduler_steps=8, async_scheduling=async_scheduling)
    params = greedy(20, stop_token_ids=[tokens[5]])
    want = run_outputs(single, [PROMPTS[3]], params)
    assert_same_outputs(run_outputs(llm, [PROMPTS[3]], params), want)
    # the prompt's step, then the loop's until the stop (under async scheduling the loop after it, dispatched
    # before the stop was seen, ends at its first step: its input is the stop token)
    assert llm.llm_engine.core.runner.stats.num_model_steps == len(want[0][0]) + async_scheduling
    again = llm.generate([PROMPTS[3] + want[0][0]], greedy(5), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == single.generate([PROMPTS[3] + want[0][0]], greedy(5),
                                                         use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption(test_models_dir, single, async_scheduling):
    """A 24-block pool: the loops' slots run out, requests are preempted and recomputed."""
    params = greedy(40, ignore_eos=True)
    prompts = [PROMPTS[i % 10][:20] for i in range(8)]
    want = run_outputs(single, prompts, params)
    llm = make_llm(test_models_dir, num_scheduler_steps=4, async_scheduling=async_scheduling,
                   kv_cache_memory=25 * KV_BYTES_PER_BLOCK)
    assert_same_outputs(run_outputs(llm, prompts, params), want)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0 and _loops_ran(llm)
    assert_no_leaks(llm)


def test_abort_while_a_loop_runs(test_models_dir, single):
    """Under async scheduling a loop is in flight when a request is aborted: it is
    dropped, the others' tokens are single steps'."""
    want = run_outputs(single, PROMPTS[:3], greedy(30))
    llm = make_llm(test_models_dir, num_scheduler_steps=4, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_requests([(f"r{i}", PROMPTS[i], greedy(30)) for i in range(3)])
    finished = {}
    for _ in range(4):
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert not finished and engine.core._in_flight[0].num_steps == 4
    assert [o.outputs[0].finish_reason for o in engine.abort_requests(["r1"])] == ["abort"]
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert sorted(finished) == ["r0", "r2"]
    assert [finished[r].outputs[0].token_ids for r in ("r0", "r2")] == [want[0][0], want[2][0]]
    assert_no_leaks(llm)


def test_a_request_under_a_grammar_decodes_one_step_at_a_time(test_models_dir, single):
    """Its next bitmask needs its last token: while it runs, every step is single; its
    outputs and its neighbours' are unchanged, and loops resume after it."""
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=3,
                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"])),
              greedy(30, ignore_eos=True)]
    want = run_outputs(single, PROMPTS[:2], params)
    llm = make_llm(test_models_dir, num_scheduler_steps=4)
    assert_same_outputs(run_outputs(llm, PROMPTS[:2], params), want)
    assert _loops_ran(llm)
    assert_no_leaks(llm)


def test_lora(test_models_dir, tmp_path, shared_cache_dir):
    """Adapters stay applied to each row over a loop's steps."""
    import make_test_model

    from jaxllm.lora.request import LoRARequest

    path = make_test_model.write_lora_adapter(test_models_dir / "llama", tmp_path / "a1", rank=8, seed=1, scale=0.5)
    adapter = LoRARequest("a1", 1, str(path))
    # tests/lora/test_lora.py's one-slot engine (and its server's) in the run's shared compilation cache: K = 4 is
    # that engine, K = 1 its step shapes without the loops; whichever starts first compiles them
    options = dict(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8, kv_cache_memory=25 * KV_BYTES_PER_BLOCK,
                   compilation_cache_dir=str(shared_cache_dir))
    runs = []
    for k in (1, 4):
        llm = make_llm(test_models_dir, num_scheduler_steps=k, **options)
        outs = [llm.generate(PROMPTS[i:i + 1], greedy(20, ignore_eos=True), use_tqdm=False,
                             lora_request=adapter if i % 2 else None) for i in range(2)]
        both = llm.generate(PROMPTS[:2], greedy(20, ignore_eos=True), use_tqdm=False, lora_request=adapter)
        runs.append([o[0].outputs[0].token_ids for o in outs] + [o.outputs[0].token_ids for o in both])
        assert k == 1 or _loops_ran(llm)
    assert runs[1] == runs[0]
    assert runs[0][1] != runs[0][0]  # the adapter changes the tokens


def _scheduler(num_steps: int, num_blocks: int = 64, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, enable_caching=False), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=64, max_model_len=128, num_scheduler_steps=num_steps)


def _request(i: int, **params) -> Request:
    req = EngineCoreRequest(f"r{i}", list(range(3, 9)), SamplingParams(**({"max_tokens": 50} | params)), None, 0.0)
    return Request.from_engine_core_request(req, req.sampling_params.max_tokens, 0)


def _decode_once(sched: Scheduler) -> dict[str, int]:
    """Schedule and give every scheduled request the tokens it asked for (token 5)."""
    from jaxllm.messages import ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(ids, [[5] * out.decode_steps.get(r, 1) for r in ids]))
    return out.decode_steps


def test_the_scheduler_hands_over_steps_only_when_every_request_decodes():
    sched = _scheduler(4)
    sched.add_request(_request(0, max_tokens=6))
    sched.add_request(_request(1, min_tokens=3))
    assert _decode_once(sched) == {}  # the prompts
    assert _decode_once(sched) == {"r0": 2, "r1": 2}  # r1 below min_tokens: 1 output + 2 = 3; the loop stops at 2
    assert _decode_once(sched) == {"r0": 3, "r1": 3}  # r0's room, 6 - 3: the loop ends with it
    sched.add_request(_request(2))
    assert _decode_once(sched) == {}  # r2 can be admitted (its prompt)
    assert _decode_once(sched) == {"r1": 4, "r2": 4}  # r0 finished
    sched.requests["r2"].spec_token_ids = [7]
    assert _decode_once(sched) == {}  # a draft to verify
    # a full batch: those waiting could not be admitted anyway
    full = _scheduler(4, max_num_seqs=1)
    full.add_request(_request(0))
    full.add_request(_request(1))
    _decode_once(full)
    assert _decode_once(full) == {"r0": 4}
    # the loop ends where a request reaches max_model_len (7 tokens after its prompt's step, 10 at most)
    near = Scheduler(KVCacheManager(64, 4, enable_caching=False), max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=10, num_scheduler_steps=4)
    near.add_request(_request(0))
    _decode_once(near)
    assert _decode_once(near) == {"r0": 3}
    # a pool too small for four steps of every request: single steps
    small = _scheduler(4, num_blocks=5)  # 4 blocks of 4 tokens: the prompts take them all
    small.add_request(_request(0, max_tokens=3))
    small.add_request(_request(1, max_tokens=3))
    _decode_once(small)
    assert _decode_once(small) == {}


def test_the_device_stop_check():
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    limits = DecodeLimits(max_steps=i32([8, 8, 8]), stop_token_ids=i32([[2, -1], [2, 3], [2, -1]]),
                          min_tokens=i32([0, 0, 5]), num_steps=i32(8))
    got = stops(limits, i32([0, 0, 3]), i32([2, 3, 2]))
    np.testing.assert_array_equal(got, [True, True, False])  # row 2 samples its 4th output, below min_tokens 5


def test_loop_shapes():
    assert loop_buckets(token_buckets(32), 4, 4) == [StepShape(1, 1, 1, 4), StepShape(4, 4, 4, 4)]
    assert loop_buckets(token_buckets(512), 64, 8)[-1] == StepShape(64, 64, 64, 8)
    assert loop_buckets(token_buckets(32), 4, 1) == []


def test_config():
    assert EngineConfig().decode_steps == EngineConfig().num_scheduler_steps > 1
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert spec.decode_steps == 1
    with pytest.raises(ValueError, match="num_scheduler_steps: must be a positive integer"):
        EngineConfig(num_scheduler_steps=0)
