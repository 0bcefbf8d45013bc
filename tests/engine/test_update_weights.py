"""LLM.update_weights (issue 64): new weights in, as jaxllm's parameter tree or by HF
tensor names; the oracle is an engine started from the same weights saved as a
checkpoint. A mismatch is refused whole, the prefix cache never serves K/V of the old
weights, a quantized engine quantizes float weights as at load, and with the xla
linear backend the given arrays are used as they are (no copy)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.loaders.hf import save_hf_folder
from jaxllm.loaders.weights import params_to_hf_tensors
from tests.support.llm import KV_BYTES_PER_BLOCK, LAZY, assert_no_leaks, make_llm

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)


def trained(params, seed: int = 0):
    """A trainer's step: every float array moved by a little noise."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [a + 0.05 * jax.random.normal(k, a.shape, a.dtype) if a.dtype.kind == "f" else a
                                     for a, k in zip(leaves, keys)])


def saved(test_models_dir, tmp_path, params):
    """`params` as a checkpoint folder of the llama test model (its tokenizer too)."""
    original = load_model(test_models_dir / "llama", dtype="float32")
    return save_hf_folder(tmp_path / "trained", original.config, params, original.tokenizer)


def outputs(llm: LLM):
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]]) for o in got]


def assert_same(got, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-6, rtol=0)


def test_pytree_and_hf_names_equal_loading_the_weights(test_models_dir, tmp_path):
    """After update_weights the engine gives exactly what an engine started from the
    new weights gives, the same prompts included (cached under the old weights: they
    are recomputed); HF names bring the old weights back."""
    llm = make_llm(test_models_dir)
    before = outputs(llm)
    original = load_model(test_models_dir / "llama", dtype="float32")
    new = trained(original.params)
    want = outputs(LLM(str(saved(test_models_dir, tmp_path, new)), **_options()))
    hits = llm.llm_engine.core.kv_cache_manager.prefix_cache_stats.hits
    llm.update_weights(new)
    assert_same(outputs(llm), want)
    assert llm.llm_engine.core.kv_cache_manager.prefix_cache_stats.hits == hits  # nothing of the old weights' K/V
    llm.update_weights(params_to_hf_tensors(original.config, original.params))
    assert_same(outputs(llm), before)
    assert_no_leaks(llm)


def _options() -> dict:
    """make_llm's engine (its executables are the same)."""
    return dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, block_size=16,
                kv_cache_memory=64 * KV_BYTES_PER_BLOCK, attention_backend="cpu", linear_backend="cpu", progress=False,
                **LAZY)


def test_a_mismatch_is_refused_whole(test_models_dir):
    llm = make_llm(test_models_dir)
    before = outputs(llm)
    params = trained(load_model(test_models_dir / "llama", dtype="float32").params)
    layers = list(params.layers)
    wrong = layers[1].replace(wqkv=layers[1].wqkv[:, :-1])
    with pytest.raises(ValueError, match=r"weights: \.layers\[1\]\.wqkv is float32\[\d+, \d+\], the engine's"):
        llm.update_weights(params.replace(layers=tuple(layers[:1] + [wrong] + layers[2:])))
    with pytest.raises(ValueError, match=r"\.final_norm is bfloat16\[128\], the engine's float32\[128\]"):
        llm.update_weights(params.replace(final_norm=params.final_norm.astype("bfloat16")))
    tensors = params_to_hf_tensors(load_model(test_models_dir / "llama").config, params)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.down_proj.weight'"):
        llm.update_weights(tensors)
    assert_same(outputs(llm), before)  # nothing applied


@pytest.mark.slow  # (24 s: the default run's budget) a float engine's updates by default above
def test_a_quantized_engine_quantizes_float_weights_as_at_load(test_models_dir, tmp_path):
    llm = make_llm(test_models_dir, quantization="q8_0")
    new = trained(load_model(test_models_dir / "llama", dtype="float32").params, seed=1)
    want = outputs(LLM(str(saved(test_models_dir, tmp_path, new)), quantization="q8_0", **_options()))
    llm.update_weights(new)
    assert_same(outputs(llm), want)


def test_the_xla_backend_takes_the_arrays_as_they_are(test_models_dir):
    """No copy: the engine's weights after the update are the very arrays given."""
    llm = make_llm(test_models_dir, linear_backend="xla", max_num_seqs=1, max_num_batched_tokens=4,
                   num_scheduler_steps=1)  # two step shapes to compile: nothing runs
    new = trained(load_model(test_models_dir / "llama", dtype="float32").params, seed=2)
    llm.update_weights(new)
    held = jax.tree.leaves(llm.llm_engine.core.runner.weights["xla"])
    assert all(a is b for a, b in zip(held, jax.tree.leaves(new), strict=True))


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_requests_in_flight_by_mode(test_models_dir, mode):
    """LLMEngine.update_weights with requests running: abort ends them (finish_reason
    abort), wait lets them finish on the old weights (the tokens of a run without the
    update); their outputs come back from the call either way."""
    llm = make_llm(test_models_dir)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.llm_engine
    engine.add_requests([(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    for _ in range(3):
        engine.step()
    new = trained(load_model(test_models_dir / "llama", dtype="float32").params, seed=3)
    finished = {o.request_id: o for o in engine.update_weights(new, mode=mode) if o.finished}
    assert set(finished) == {f"r{i}" for i in range(len(PROMPTS))}
    for i, want in enumerate(alone):
        got = finished[f"r{i}"].outputs[0]
        if mode == "abort":
            assert got.finish_reason == "abort" and len(got.token_ids) < 40
        else:
            assert got.finish_reason == "length" and got.token_ids == want.outputs[0].token_ids
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="mode: unknown 'later'"):
        engine.update_weights(new, mode="later")
    assert_no_leaks(llm)
