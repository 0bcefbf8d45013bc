"""sleep / wake_up (issue 64): the device memory of the KV cache and the weights given
back (the process's live JAX buffers fall to an engine's without them) and the same
tokens after waking, with nothing compiled; level 2's weights come back with
update_weights."""

from __future__ import annotations

import jax
import pytest

from jaxllm import SamplingParams
from jaxllm.loaders import load_model
from tests.support.llm import assert_no_leaks, make_llm

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def tokens(llm):
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kv", ["auto", pytest.param("fp8-scaled", marks=pytest.mark.slow)])
def test_level_1_round_trip(test_models_dir, kv):
    options = dict(kv_cache_dtype="fp8", calculate_kv_scales=True) if kv == "fp8-scaled" else {}
    llm = make_llm(test_models_dir, enable_sleep_mode=True, **options)
    runner = llm.llm_engine.core.runner
    before = tokens(llm)
    awake = live_bytes()
    held = sum(a.nbytes for a in {id(a): a for a in jax.tree.leaves((runner.weights, runner.kv_caches))}.values())
    llm.sleep(1)
    assert llm.is_sleeping() and awake - live_bytes() >= held  # every weight and cache array given back
    with pytest.raises(ValueError, match="the engine is asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["kv_cache"])
    assert llm.is_sleeping()  # the weights are still on the host
    llm.wake_up()
    assert not llm.is_sleeping()
    assert tokens(llm) == before  # (fp8: its calculated scales kept through the sleep)
    assert_no_leaks(llm)  # nothing compiled after warm-up


def test_level_2_takes_weights_from_update_weights(test_models_dir):
    llm = make_llm(test_models_dir, enable_sleep_mode=True)
    before = tokens(llm)
    llm.sleep(2)
    llm.wake_up()
    assert llm.is_sleeping()  # no weights until update_weights
    llm.update_weights(load_model(test_models_dir / "llama", dtype="float32").params)
    assert not llm.is_sleeping() and tokens(llm) == before
    assert_no_leaks(llm)


def test_refusals(test_models_dir):
    llm = make_llm(test_models_dir)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    llm = make_llm(test_models_dir, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="level: 1 .* or 2"):
        llm.sleep(3)
    llm.sleep()
    with pytest.raises(RuntimeError, match="asleep already"):
        llm.sleep()
    with pytest.raises(ValueError, match=r"tags: unknown \['kv'\]"):
        llm.wake_up(["kv"])
    llm.wake_up()


def test_a_trainers_arrays_stay_valid(test_models_dir):
    """Weights given to update_weights are held as they are (xla backend: no copy); a
    sleep lets the engine's reference go without deleting them: the trainer's copy
    still reads, and the engine wakes with it."""
    llm = make_llm(test_models_dir, enable_sleep_mode=True, linear_backend="xla", max_num_seqs=1,
                   max_num_batched_tokens=4, num_scheduler_steps=1)  # two step shapes (test_update_weights' xla engine)
    weights = load_model(test_models_dir / "llama", dtype="float32").params
    llm.update_weights(weights)
    before = tokens(llm)
    llm.sleep(1)
    assert not any(a.is_deleted() for a in jax.tree.leaves(weights))
    llm.wake_up()
    assert tokens(llm) == before
