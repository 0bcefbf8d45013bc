"""pause_generation / resume_generation (issue 64, vLLM's modes): "abort" ends what
runs, "wait" runs it to its end, "keep" holds it to go on after resume (recomputed
when the cache is cleared or the weights change); requests added while paused wait
for resume. Oracles: the same requests run without a pause, and for a kept request
across a weight update, the new weights continuing its tokens so far."""

from __future__ import annotations

import pytest

from jaxllm import SamplingParams
from jaxllm.engine.output_processor import RequestOutputKind
from jaxllm.loaders import load_model
from tests.engine.test_update_weights import trained
from tests.support.llm import assert_no_leaks, make_llm

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def start(llm, n_steps: int = 3, prefix: str = "r") -> dict[str, list[int]]:
    """The prompts queued on llm's engine and stepped `n_steps` times; tokens so far by id."""
    engine = llm.llm_engine
    engine.add_requests([(f"{prefix}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)],
                        output_kind=RequestOutputKind.CUMULATIVE)
    seen: dict[str, list[int]] = {}
    for _ in range(n_steps):
        record(seen, engine.step())
    return seen


def record(seen: dict, outputs) -> dict[str, object]:
    """Each output's tokens so far into `seen`; the finished outputs by id."""
    for o in outputs:
        seen[o.request_id] = list(o.outputs[0].token_ids)
    return {o.request_id: o for o in outputs if o.finished}


def run_out(engine, seen: dict) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        finished |= record(seen, engine.step())
    return finished


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(test_models_dir, request):
    return make_llm(test_models_dir, async_scheduling=request.param)


@pytest.fixture(scope="module")
def alone(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_abort_ends_what_runs_and_holds_what_comes(llm, alone):
    engine = llm.llm_engine
    start(llm)
    ended = {o.request_id: o for o in engine.pause_generation("abort")}
    assert sorted(ended) == ["r0", "r1", "r2"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in ended.values())
    assert engine.is_paused() and not engine.core.has_unfinished_requests()
    engine.add_requests([("late", PROMPTS[0], GREEDY)])
    for _ in range(3):
        assert engine.step() == []  # held until resume
    assert engine.core.scheduler.make_stats().num_waiting == 1
    with pytest.raises(RuntimeError, match="the engine is paused: resume_generation"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.resume_generation()
    finished = run_out(engine, {})
    assert finished["late"].outputs[0].token_ids == alone[0]
    assert_no_leaks(llm)


def test_wait_finishes_what_runs_and_holds_what_comes(llm, alone):
    engine = llm.llm_engine
    seen = start(llm)
    engine.add_requests([("before", PROMPTS[1], GREEDY)])  # queued before the pause: it runs too
    finished = record(seen, engine.pause_generation("wait"))
    assert sorted(finished) == ["before", "r0", "r1", "r2"]
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(3)] == alone
    assert engine.core.is_drained() and engine.core.kv_cache_manager.num_used_blocks == 0
    engine.add_requests([("after", PROMPTS[2], GREEDY)])
    assert engine.step() == [] and engine.has_unfinished_requests()
    engine.resume_generation()
    assert run_out(engine, {})["after"].outputs[0].token_ids == alone[2]
    assert_no_leaks(llm)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_goes_on_after_resume(llm, alone, clear_cache):
    """Kept requests end with the tokens of a run never paused: their KV kept, or
    (clear_cache) let go and recomputed from their tokens."""
    engine = llm.llm_engine
    seen = start(llm)
    record(seen, engine.pause_generation("keep", clear_cache=clear_cache))
    assert not engine.core.has_work() and engine.core.has_unfinished_requests()
    used = engine.core.kv_cache_manager.num_used_blocks
    assert (used == 0) if clear_cache else (used > 0)
    for _ in range(2):
        record(seen, engine.step())
    assert all(len(seen[f"r{i}"]) < MAX_TOKENS for i in range(3))  # nothing ran while paused
    engine.resume_generation()
    finished = run_out(engine, seen)
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(3)] == alone
    assert_no_leaks(llm)


def test_keep_across_a_weight_update_continues_with_the_new_weights(test_models_dir):
    """update_weights(mode="keep"): each request keeps the tokens the old weights gave
    and goes on exactly as the new weights continue those tokens."""
    llm = make_llm(test_models_dir)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = llm.llm_engine
    seen = start(llm, n_steps=4)
    new = trained(load_model(test_models_dir / "llama", dtype="float32").params, seed=4)
    record(seen, engine.update_weights(new, mode="keep"))
    kept = [seen[f"r{i}"] for i in range(3)]
    assert all(0 < len(k) < MAX_TOKENS for k in kept) and not engine.is_paused()
    finished = run_out(engine, seen)
    continued = llm.generate(
        [{"prompt_token_ids": o.prompt_token_ids + k} for o, k in zip(
            llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False), kept)],
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS - len(k), ignore_eos=True) for k in kept],
        use_tqdm=False)
    for i, (k, c) in enumerate(zip(kept, continued)):
        got = finished[f"r{i}"].outputs[0].token_ids
        assert got[:len(k)] == before[i][:len(k)]  # the old weights' tokens
        assert got[len(k):] == c.outputs[0].token_ids  # the new weights' continuation
    assert_no_leaks(llm)


def test_kept_requests_sleep_with_the_engine(test_models_dir):
    """pause(keep), sleep, wake_up, resume: the kept requests end as if never paused."""
    llm = make_llm(test_models_dir, enable_sleep_mode=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = llm.llm_engine
    seen = start(llm)
    record(seen, engine.pause_generation("keep", clear_cache=False))
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="resume: the engine is asleep"):
        engine.resume_generation()
    llm.wake_up()
    engine.resume_generation()
    finished = run_out(engine, seen)
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(3)] == alone
    assert_no_leaks(llm)


def test_refusals(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="mode: unknown 'later'; choose one of abort, wait, keep"):
        engine.pause_generation("later")
    assert not engine.is_paused()
    start(llm, prefix="x")
    with pytest.raises(RuntimeError, match=r"update_weights: requests are in flight; .* or pause\(\) first"):
        engine.core.update_weights(llm.llm_engine.core.model.params)
    engine.abort_requests(["x0", "x1", "x2"])
    run_out(engine, {})
    assert_no_leaks(llm)
