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
from tests.support.llm import KV_BYTES_PER_BLOCK, LAZY


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
              kv_cache_memory="1MiB", attention_backend=attention, linear_backend=linear, progress=False, **LAZY)
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


def _reported(out) -> list[float]:
    """An output's prompt logprobs (from the second token) and sampled tokens' logprobs."""
    lps = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
    return lps + [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


@pytest.fixture(scope="module")
def invariant_llm(test_models_dir):
    """A batch-invariant engine short of KV blocks: 96 tokens of KV for the three prompts
    below, so some are preempted and computed again."""
    return LLM(str(test_models_dir / "llama"), max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
               kv_cache_memory=7 * KV_BYTES_PER_BLOCK, batch_invariant=True, dtype="float32", quantization="none",
               progress=False, **LAZY)


def test_batch_invariant_engine_equals_the_trainers_bits(invariant_llm, test_models_dir):
    """batch_invariant=True: what the engine reports for a sequence is the same bits
    batched with others (chunked prefill beside decodes and decode loops, preemption and
    recomputation) and alone (its shared prefix then a prefix-cache hit), and the same
    bits as the trainer's forward (sequence_logprobs(batch_invariant=True)) over the
    sampled sequences right-padded into one batch; its gradient is the dense forward's."""
    llm = invariant_llm
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(3, 500, 20)]
    prompts = [shared + [int(t) for t in rng.integers(3, 500, n)] for n in (3, 30, 11)]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    hits = 0
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        hits += alone.num_cached_tokens
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert _reported(alone) == _reported(out)
    assert hits > 0

    model = load_model(test_models_dir / "llama", dtype="float32")
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in together]
    width = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    trainer = jax.jit(sequence_logprobs, static_argnums=(1, 5))
    got = np.asarray(trainer(model.params, model.config, batch, None, None, True))
    for row, seq, out in zip(got, seqs, together):
        np.testing.assert_array_equal(row[1:len(seq)], np.asarray(_reported(out), np.float32))

    def total(p, invariant):
        return sequence_logprobs(p, model.config, batch[:, :16], batch_invariant=invariant).sum()

    g_inv = jax.jit(jax.grad(total), static_argnums=1)(model.params, True)
    g_plain = jax.jit(jax.grad(total), static_argnums=1)(model.params, False)
    for a, b in zip(jax.tree.leaves(g_inv), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_batch_invariant_refuses_what_it_cannot_keep():
    from jaxllm.engine.config import EngineConfig

    assert EngineConfig(batch_invariant=True).linear_backend == "cpu"
    with pytest.raises(ValueError, match="dtype: batch_invariant needs float32"):
        EngineConfig(batch_invariant=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="attention_backend: batch_invariant needs cpu"):
        EngineConfig(batch_invariant=True, attention_backend="xla")
    with pytest.raises(ValueError, match="enable_lora: not with batch_invariant"):
        EngineConfig(batch_invariant=True, enable_lora=True)


def test_a_trainer_holding_the_cpu_layout_updates_the_engine_without_a_copy(invariant_llm, test_models_dir):
    """A trainer keeping its parameters in the cpu backend's layout (pack_params, once):
    a step on them, then update_weights, and the batch-invariant engine holds the very
    arrays (no copy), its logprobs the trainer's forward's bit for bit; the gradient
    reaches every packed array, and a step along it raises the logprobs. (After the test
    above: the module's engine takes other weights here.)"""
    from jaxllm.models.linear import pack_params

    llm = invariant_llm
    model = load_model(test_models_dir / "llama", dtype="float32")
    packed = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(3), a.shape, a.dtype)
                          if a.dtype.kind == "f" else a, pack_params(model.params))  # a trainer's step
    llm.update_weights(packed)
    held = jax.tree.leaves(llm.llm_engine.core.runner.weights["cpu"])
    assert all(a is b for a, b in zip(held, jax.tree.leaves(packed), strict=True))
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 500, 21)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=1.0, seed=2, max_tokens=6,
                       logprobs=0, prompt_logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    ids = jnp.asarray([out.prompt_token_ids + out.outputs[0].token_ids], jnp.int32)

    def total(p):
        return sequence_logprobs(p, model.config, ids, batch_invariant=True).sum()

    mine = jax.jit(sequence_logprobs, static_argnums=(1, 5))(packed, model.config, ids, None, None, True)
    np.testing.assert_array_equal(np.asarray(mine)[0, 1:], np.asarray(_reported(out), np.float32))
    value, grads = jax.jit(jax.value_and_grad(total))(packed)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert float(jax.jit(total)(jax.tree.map(lambda p, g: p + 1e-3 * g, packed, grads))) > float(value)


def test_norms_sum_a_row_alike_in_any_batch():
    """rms_norm's mean square (llama.row_sums) is the same bits for a row alone and in a
    batch of any size (XLA's reduce summed 7 rows of 576 otherwise than 8 on the Xeon),
    and within float32 rounding of float64's."""
    from jaxllm.models.llama import rms_norm

    rng = np.random.default_rng(5)
    x = (3 * rng.standard_normal((40, 576))).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    norm = jax.jit(lambda a: rms_norm(a, jnp.asarray(w), 1e-5))
    full = np.asarray(norm(jnp.asarray(x)))
    for n in (1, 2, 3, 5, 7, 8, 9, 16, 17, 33):
        np.testing.assert_array_equal(np.asarray(norm(jnp.asarray(x[:n]))), full[:n])
    x64 = x.astype(np.float64)
    want = w * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(full, want, rtol=2e-6, atol=2e-6)


def test_params_packed_as_traced_equal_the_host_s(test_models_dir):
    """pack_params under jit (a trainer's forward packs as it goes) gives the panels the
    engine packs on the host, bit for bit, and unpack_params gives the weights back."""
    from jaxllm.models.linear import pack_params, unpack_params

    params = load_model(test_models_dir / "llama", dtype="float32").params
    host = pack_params(params)
    traced = jax.jit(pack_params)(params)
    assert jax.tree.structure(traced) == jax.tree.structure(host)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(jax.jit(unpack_params)(host)), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
