"""Async scheduling (`async_scheduling=True`): each step is scheduled and dispatched while
the one before runs, the tokens that one samples read from the device's token history.
Every output must be the synchronous engine's: tokens and finish reasons exactly,
logprobs and prompt logprobs to float32 rounding (a request that stops keeps its seat
one step longer, so a prompt may be cut into other chunks, and the attention over a
chunk sums in another order), under greedy, seeded, penalized, min_tokens and
stop-token sampling, chunked prefill, preemption, aborts and structured outputs; and
nothing leaks."""

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.core.request import RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.config import EngineConfig
from jaxllm.sampling_params import StructuredOutputsParams
from tests.support import multidevice
from tests.support.llm import KV_BYTES_PER_BLOCK, LAZY, assert_no_leaks, make_llm
from tests.support.outputs import PROMPTS, assert_same_outputs, greedy, run_outputs, varied_params
from tests.support.server import Server


@pytest.fixture(scope="module")
def engines(test_models_dir):
    """The synchronous engine and the async one, on the same model and options."""
    return make_llm(test_models_dir), make_llm(test_models_dir, async_scheduling=True)


def _sync_then_async(prompts, params, make) -> tuple[list, list]:
    """The outputs of the engines `make(**options)` makes, synchronous then async, and
    the engines, each left with nothing in use."""
    runs, engines = [], []
    for options in ({}, {"async_scheduling": True}):
        engines.append(make(**options))
        runs.append(run_outputs(engines[-1], prompts, params))
        assert_no_leaks(engines[-1])
    return runs, engines


def _pressured(test_models_dir, **options):
    """An engine whose 24-block pool preempts (checked after its run by the callers)."""
    return make_llm(test_models_dir, kv_cache_memory=25 * KV_BYTES_PER_BLOCK, **options)


def test_outputs_are_the_synchronous_engines(engines):
    sync, asynchronous = engines
    tokens = sync.generate(PROMPTS[5], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    params = varied_params(stop_token=tokens[3])  # PROMPTS[5]'s 4th greedy token: the stop requests stop early
    want = run_outputs(sync, PROMPTS, params)
    assert want[5][1] == "stop" and len(want[5][0]) == 4 and len(want[6][0]) >= 6
    assert_same_outputs(run_outputs(asynchronous, PROMPTS, params), want)
    for llm in engines:
        assert_no_leaks(llm)


def test_a_lone_request_and_a_second_batch(engines):
    """Batch 1 (every step has a step in flight before it) and a batch after an idle engine."""
    sync, asynchronous = engines
    for prompts, params in (([PROMPTS[3]], greedy(40, ignore_eos=True)),
                            (PROMPTS[:4], greedy(9))):
        assert_same_outputs(run_outputs(asynchronous, prompts, params), run_outputs(sync, prompts, params))
    assert_no_leaks(asynchronous)


def test_preemption_gives_the_same_tokens(test_models_dir, monkeypatch):
    """A pool too small for the batch: requests are preempted, some while a step that
    samples for them runs, and recomputed with the token it brings."""
    params = greedy(40, ignore_eos=True)
    prompts = [PROMPTS[i % 10][:20] for i in range(8)]
    append, to_preempted = Scheduler._append_tokens, []

    def appending(self, request, tokens):
        if request.status is not RequestStatus.RUNNING:
            to_preempted.append(request.request_id)
        return append(self, request, tokens)

    monkeypatch.setattr(Scheduler, "_append_tokens", appending)
    results, engines = _sync_then_async(prompts, params, lambda **o: _pressured(test_models_dir, **o))
    assert all(llm.llm_engine.core.scheduler.num_preemptions > 0 for llm in engines)
    assert to_preempted  # the async engine's path: a token for a request preempted after its step was dispatched
    assert_same_outputs(results[1], results[0])


def test_abort_while_its_step_runs(engines):
    """A request aborted between steps (its next step already dispatched) is dropped;
    the others' tokens are the synchronous engine's."""
    sync, asynchronous = engines
    want = run_outputs(sync, PROMPTS[:3], greedy(15))
    engine = asynchronous.llm_engine
    engine.add_requests([(f"r{i}", PROMPTS[i], greedy(15)) for i in range(3)])
    finished = {}
    for _ in range(4):
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert not finished  # 15 tokens each: none is done after 4 steps
    assert [o.outputs[0].finish_reason for o in engine.abort_requests(["r1"])] == ["abort"]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["r0", "r2"]
    assert finished["r0"].outputs[0].token_ids == want[0][0]
    assert finished["r2"].outputs[0].token_ids == want[2][0]
    assert_no_leaks(asynchronous)


def test_structured_outputs_wait_for_the_tokens(engines):
    """A request under a grammar needs the step before's tokens for its bitmask: the
    engine collects that step first; its outputs and its neighbours' are unchanged."""
    sync, asynchronous = engines
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=3,
                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"])),
              greedy(10)]
    assert_same_outputs(run_outputs(asynchronous, PROMPTS[:2], params), run_outputs(sync, PROMPTS[:2], params))
    assert_no_leaks(asynchronous)


def test_refuses_speculative_decoding():
    with pytest.raises(ValueError, match="async_scheduling: not with speculative_config"):
        EngineConfig(async_scheduling=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


def test_the_engine_keeps_no_step_in_flight_when_done(engines):
    """After the last outputs, one more step collects the step that ran for requests
    that had already finished; the engine then reports nothing unfinished."""
    _, asynchronous = engines
    engine = asynchronous.llm_engine
    engine.add_requests([("x", PROMPTS[2], greedy(3))])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps >= 3 and engine.core._in_flight is None
    assert engine.core.describe().endswith("; async scheduling")  # the start-up line says so


@pytest.mark.slow  # a server start (~40 s); the default run steps the same EngineCore in process
def test_the_server_with_async_scheduling(test_models_dir, tmp_path, engines):
    """`python -m jaxllm.serve --async-scheduling`: the engine core process steps the
    same way; completions, several prompts and a stream, give the offline synchronous
    engine's text."""
    sync, _ = engines
    server = Server(test_models_dir / "llama", tmp_path, "--async-scheduling", "--served-model-name", "tiny",
                    measure=True)
    try:
        client = server.client()
        prompts = [PROMPTS[i] for i in (1, 4, 7)]
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        want = [o.outputs[0].text for o in sync.generate(prompts, greedy(12, ignore_eos=True), use_tqdm=False)]
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
        stream = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want[1]
    finally:
        server.stop()


# In the slow run (~20 s each: the default run's budget): the hybrid cache by default in
# tests/core/test_hybrid_kv_cache.py, async scheduling by default above
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_windows_and_the_hybrid_cache(test_models_dir, arch):
    """Sliding-window layers free the blocks behind their window as requests advance
    (Gemma 3: a block table per layer group): a block freed while the step before still
    reads it is written only by later steps, which run after it. Same greedy tokens."""
    prompts = PROMPTS + [p[:30] * 3 for p in PROMPTS[5:]]
    runs, _ = _sync_then_async(prompts, greedy(40, ignore_eos=True), lambda **o: LLM(
        str(test_models_dir / arch), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16,
        kv_cache_memory=4 * 2**20, attention_backend="cpu", linear_backend="cpu", progress=False, **LAZY, **o))
    assert [r[0] for r in runs[1]] == [r[0] for r in runs[0]]


@pytest.mark.slow  # two engines over simulated devices in a subprocess (~1 min)
def test_tensor_parallel(test_models_dir):
    """Sharded over two devices, scheduled asynchronously: one device's tokens (and
    logprobs to 1e-4), with prefix caching, chunking and a forced preemption."""
    multidevice.run("tp_engine_matches", str(test_models_dir / "llama"), "2", "auto", "float32", "1", devices=2)


def test_prompt_logprobs_under_preemption(test_models_dir):
    """Requests scoring their prompts in a pool that preempts, some mid-prompt while a
    step that computes their rows runs (its rows arrive before they are admitted
    again): every prompt position scored once, as the synchronous engine scores it."""
    rng = np.random.default_rng(17)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (3, 150, 40, 90, 7, 120, 64, 33, 100, 12)]
    params = [greedy(20, logprobs=1, prompt_logprobs=1, n=2 if i == 3 else 1) for i in range(len(prompts))]
    runs, engines = _sync_then_async(prompts, params, lambda **o: _pressured(test_models_dir, **o))
    assert all(llm.llm_engine.core.scheduler.num_preemptions > 0 for llm in engines)
    for prompt, got in zip(prompts, runs[1]):
        assert len(got[4]) == len(prompt) and got[4][0] is None
    assert_same_outputs(runs[1], runs[0])
