"""The plain forward (jaxllm.models.dense, issue 64): the logprobs a trainer computes
with the engine's model functions equal HF's and the engine's own for the same tokens,
and it differentiates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from jaxllm.models.dense import sequence_logprobs


def hf_logprobs(folder, ids: list[int]) -> np.ndarray:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1).numpy()
    return np.concatenate([[0.0], lp[np.arange(len(ids) - 1), ids[1:]]])


@pytest.mark.parametrize("name", ["llama", "gemma2", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("gemma3", marks=pytest.mark.slow)])
def test_equals_hf(test_models_dir, name):
    """Sliding windows, soft caps, q/k norms: float32 logprobs within 1e-4 of HF's
    float64 ones over a batch of two sequences."""
    model = load_model(test_models_dir / name, dtype="float32")
    rng = np.random.default_rng(0)
    batch = np.asarray([rng.integers(3, 500, 40) for _ in range(2)], np.int32)
    got = np.asarray(jax.jit(sequence_logprobs, static_argnums=1)(model.params, model.config, jnp.asarray(batch)))
    for row, ids in zip(got, batch):
        np.testing.assert_allclose(row, hf_logprobs(test_models_dir / name, ids.tolist()), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backends", [("cpu", "cpu"), pytest.param(("xla", "xla"), marks=pytest.mark.slow)],
                         ids=lambda b: f"attention-{b[0]}-linear-{b[1]}")
def test_equals_the_engines_logprobs(test_models_dir, backends):
    """What the engine reported while sampling (prompt logprobs and each sampled token's,
    chunked prefill and a batch of several) is what the plain forward gives for those
    tokens: the trainer's logprobs and the sampler's agree, up to float32 sums taken in
    other orders (paged attention's chunks, the batch's matrix shapes). Measured on an
    Intel Xeon, 2026-11-30: at most 1.9e-5 (cpu backends) and 1.8e-5 (xla), against
    issue 64's target of 1e-6, not met yet."""
    attention, linear = backends
    llm = LLM(str(test_models_dir / "llama"), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
              kv_cache_memory="1MiB", attention_backend=attention, linear_backend=linear, progress=False)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (9, 40, 23)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=0, prompt_logprobs=0,
                                                ignore_eos=True), use_tqdm=False)
    model = load_model(test_models_dir / "llama", dtype="float32")
    worst = 0.0
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        engine = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        engine += [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        mine = np.asarray(jax.jit(sequence_logprobs, static_argnums=1)(model.params, model.config,
                                                                       jnp.asarray([tokens])))[0, 1:]
        worst = max(worst, float(np.abs(mine - np.asarray(engine)).max()))
    assert worst < 5e-5, worst


def test_differentiates(test_models_dir):
    """jax.grad of the sequences' summed logprobs: every float parameter gets a finite
    gradient, and one step along it raises the sum (a policy-gradient step's smallest
    check)."""
    model = load_model(test_models_dir / "llama", dtype="float32")
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 500, (2, 16)), jnp.int32)

    def total(params):
        return sequence_logprobs(params, model.config, ids).sum()

    value, grads = jax.jit(jax.value_and_grad(total))(model.params)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)
    stepped = jax.tree.map(lambda p, g: p + 1e-3 * g, model.params, grads)
    assert float(jax.jit(total)(stepped)) > float(value)
