"""Every architecture against HF transformers (PyTorch, float32) on the same folder:
prompt logits computed as one prefill, in chunks, and token by token through the paged
cache (shuffled, non-contiguous block tables, padding in every step), a mixed ragged
step, and the greedy continuation; with plain weights (XLA's dot) and with the weights
packed for the `cpu` linear backend."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from jaxllm.loaders import load_model
from jaxllm.models.linear import pack_params
from tests.support.llm import LAZY
from tests.support.models import ARCHITECTURES, MOE
from tests.support.paged_driver import PagedDriver

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is Paris; one two"
TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request, test_models_dir):
    path = test_models_dir / request.param
    ours = load_model(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


# Weights as XLA's dot reads them ("plain", the GPU path) and packed into panels (the
# `cpu` linear backend, the CPU default). Every family runs the CPU's layout by default;
# XLA's runs by default for Qwen2 (biases) and Qwen2-MoE (experts,
# a shared expert and a dense layer), for the others
# in the slow run (tests/conftest.py reads SLOW_CASES): the layouts differ only in the
# projections, which those two cover, and the default run has a 15-minute budget.
SLOW_CASES = ("[llama-plain]", "[mistral-plain]", "[qwen3-plain]", "[gemma3-plain]", "[gemma2-plain]", "[qwen3_moe-plain]",
              "[mixtral-plain]", "test_moe_engine_greedy_matches_hf[qwen3_moe]",
              "test_moe_engine_greedy_matches_hf[qwen2_moe]",
              # the sample rows' last layer: llama, gemma3 (hybrid, output norms) and qwen2_moe packed by default
              *(f"test_the_last_layer_on_the_sample_rows_alone[{name}-packed]"
                for name in ("mistral", "qwen2", "qwen3", "gemma2", "qwen3_moe", "mixtral")),
              "test_the_last_layer_on_the_sample_rows_alone[qwen2-plain]",
              "test_the_last_layer_on_the_sample_rows_alone[qwen2_moe-plain]",
              # XLA's layout's prompt logits: its mixed step and greedy continuation cover it by default
              "test_prompt_logits_match_hf[qwen2-plain]", "test_prompt_logits_match_hf[qwen2_moe-plain]",
              # prompt logits by default for llama, gemma3, gemma2, qwen3 and qwen2_moe; the others' greedy
              # tokens against HF's by default (Mistral is Llama's layers with a window, Mixtral's and
              # Qwen3-MoE's experts run Qwen2-MoE's code, Qwen2's biases its mixed step's)
              *(f"test_prompt_logits_match_hf[{name}-packed]" for name in ("mistral", "mixtral", "qwen2", "qwen3_moe")),
              "test_moe_engine_greedy_matches_hf[mixtral]",  # (24 s) the experts through LLM: the greedy continuations
              # the mixed step (prefill chunks beside decodes) by default for llama, gemma3 (hybrid),
              # qwen2_moe packed and qwen2 plain; every family's prompt logits and greedy tokens above
              *(f"test_mixed_ragged_step_matches_hf[{name}]" for name in (
                  "gemma2-packed", "mistral-packed", "mixtral-packed", "qwen2-packed", "qwen2_moe-plain",
                  "qwen3-packed", "qwen3_moe-packed")))
LAYOUTS = pytest.mark.parametrize("layout", ["plain", "packed"])


def weights(ours, layout: str):
    return pack_params(ours.params) if layout == "packed" else ours.params


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@LAYOUTS
def test_prompt_logits_match_hf(pair, layout):
    ours, hf = pair
    ids = ours.tokenizer.encode(PROMPT)
    assert len(ids) > 24  # longer than the mistral test model's sliding window
    ref = hf_logits(hf, ids)
    driver = PagedDriver(ours.config, weights(ours, layout), block_size=8)
    # whole, in chunks, and the last 8 tokens one a step (decodes past the mistral window)
    for chunks in ([len(ids)], [5, 7, 1, len(ids) - 13], [len(ids) - 8] + [1] * 8):
        got = driver.prompt_logits(ids, chunks)
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0, err_msg=f"chunks={chunks}")


@LAYOUTS
def test_mixed_ragged_step_matches_hf(pair, layout):
    """Sequences sharing steps: a decode beside a prefill chunk, then a prefill
    finishing beside one starting."""
    ours, hf = pair
    tok = ours.tokenizer
    a, b, c = (tok.encode(t) for t in (PROMPT, "Hello world! How are you today?", "One, two, three, four, five"))
    driver = PagedDriver(ours.config, weights(ours, layout), block_size=4)
    sa, sb, sc = (driver.new_sequence(x) for x in (a, b, c))
    (a1,) = driver.step([(sa, len(a) - 1)], all_logits=True)
    a2, b1 = driver.step([(sa, 1), (sb, 5)], all_logits=True)
    b2, c1 = driver.step([(sb, len(b) - 5), (sc, len(c))], all_logits=True)
    for got, ids in (([a1, a2], a), ([b1, b2], b), ([c1], c)):
        np.testing.assert_allclose(np.concatenate(got), hf_logits(hf, ids), atol=TOL, rtol=0)


@LAYOUTS
def test_greedy_continuation_matches_hf(pair, layout):
    ours, hf = pair
    ids = ours.tokenizer.encode(PROMPT)
    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()
    driver = PagedDriver(ours.config, weights(ours, layout), block_size=8)
    assert driver.greedy(ids, 32, chunk=11) == expected
    assert len(set(expected)) > 4  # the test model does not degenerate into one token


def test_bfloat16_compute_dtype(test_models_dir):
    """dtype="bfloat16" (the GPU default): params and KV cache bfloat16 (on the CPU the
    cache holds the bits, and the hidden states stay float32), logits close to float32's."""
    f32 = load_model(test_models_dir / "llama", dtype="float32")
    bf16 = load_model(test_models_dir / "llama", dtype="bfloat16")
    assert bf16.params.layers[0].wqkv.dtype == np.dtype("bfloat16")
    ids = f32.tokenizer.encode(PROMPT)
    driver = PagedDriver(bf16.config, bf16.params, block_size=8)
    assert driver.caches[0].format.name == "bfloat16"
    got = driver.prompt_logits(ids, [7, len(ids) - 7])
    ref = PagedDriver(f32.config, f32.params, block_size=8).prompt_logits(ids, [len(ids)])
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()  # bfloat16 keeps ~3 significant digits
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def _bfloat16_hf_oracle(hf):
    """`hf` as jaxllm runs bfloat16 weights on a CPU: every parameter rounded to
    bfloat16, every projection's input rounded to bfloat16 (forward pre-hooks), the
    rest in float32, products accumulated in float32 (exact for bfloat16 operands)."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    round_input = lambda module, args: (args[0].to(torch.bfloat16).to(torch.float32), *args[1:])
    for m in hf.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(round_input)
    return hf


def test_bfloat16_weights_float32_activations_match_rounded_hf(test_models_dir):
    """The CPU's bfloat16: bfloat16 weights under a float32 KV cache (so float32 hidden
    states; jaxllm.platform.activation_dtype), against HF with the same roundings."""
    path = test_models_dir / "llama"
    bf16 = load_model(path, dtype="bfloat16")
    hf = _bfloat16_hf_oracle(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    ids = bf16.tokenizer.encode(PROMPT)
    driver = PagedDriver(bf16.config, bf16.params, block_size=8, cache_dtype=np.float32)
    got = driver.prompt_logits(ids, [7, len(ids) - 7])
    ref = hf_logits(hf, ids)
    plain = hf_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ids)
    # Rounding to bfloat16 is discontinuous: a float32 difference in the last bit can
    # round one input element the other way (here from the 21st token on, then carried
    # by the KV cache), so the match is close on average, not to float32's 1e-4; the
    # float32 model is ~10x farther from the oracle.
    assert np.abs(got - ref).mean() < np.abs(plain - ref).mean() / 5
    assert np.abs(got - ref).max() < 0.01 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_engine_bfloat16_on_cpu_scores_like_rounded_hf(test_models_dir):
    """LLM(dtype="bfloat16") on the CPU platform: bfloat16 weights (plain or packed in
    pairs for the dense kernel, as the start-up measurement picks), a float32 KV cache
    (asked: `auto` would be bfloat16, which the oracle does not round to), the prompt's
    logprobs as the rounded HF oracle computes them."""
    from jaxllm import SamplingParams
    from tests.support.llm import make_llm

    path = test_models_dir / "llama"
    llm = make_llm(test_models_dir, dtype="bfloat16", kv_cache_dtype="float32")
    runner = llm.llm_engine.core.runner
    assert runner.kv_caches[0].k.dtype == np.float32
    held = [getattr(w.layers[0].wqkv, "panels", w.layers[0].wqkv) for w in runner.weights.values()]  # packed or plain
    assert all(a.dtype == np.dtype("bfloat16") for a in held)
    # its attention may multiply in bfloat16 where the plan found vdpbf16ps (or AMX) fast (the
    # kernel does so with a bfloat16 cache only: tests/kernels/test_cpu_attention.py)
    rounds = runner.plan.bf16_products(runner.param_dtype)
    assert all(step["attention_fn"].keywords["bf16_products"] == rounds for step in runner.compilation._steps.values())
    ids = llm.get_tokenizer().encode(PROMPT)
    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    got = np.array([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])

    def scores(model) -> np.ndarray:
        logits = torch.from_numpy(hf_logits(model, ids)[:-1])
        return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()

    ref = scores(_bfloat16_hf_oracle(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()))
    plain = scores(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    assert np.abs(got - ref).mean() < np.abs(plain - ref).mean() / 5
    assert np.abs(got - ref).max() < 0.05


@pytest.mark.parametrize("name", MOE)
def test_moe_engine_greedy_matches_hf(test_models_dir, name):
    """A Mixture-of-Experts model through LLM (the engine's bucketed, padded steps: the
    padding rows are routed too and must not disturb the real ones): 32 greedy tokens
    as HF generates them."""
    from jaxllm import LLM, SamplingParams

    path = test_models_dir / name
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, attention_backend="cpu",
              linear_backend="cpu", progress=False, **LAZY)  # the kernels named: nothing measured at start-up
    ids = llm.get_tokenizer().encode(PROMPT)
    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:7]}],
                        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected


def test_moe_experts_lower_for_cuda_as_a_ragged_matmul():
    """On a GPU the experts' matmuls are grouped (XLA's ragged dot: the work follows the
    tokens routed); the MoE MLP lowers for CUDA without a device."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models.moe import experts_mlp

    t, k, e, d, f = 64, 2, 8, 128, 64
    args = [jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, k), jnp.float32),
            jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((e, d, 2 * f), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16)]
    lowered = jax.jit(lambda *a: experts_mlp(*a, "silu")).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("\"chlo.ragged_dot\"(") == 2


@LAYOUTS
def test_the_last_layer_on_the_sample_rows_alone(pair, layout):
    """The engine's step (llama.forward_rows) runs the last layer's output projection
    and MLP on the rows it samples from alone (unless prompt logprobs need every row):
    those rows' logits are the ones running every row gives (to float32 rounding: XLA
    vectorizes the norms' sums by the row count), through prefill chunks, a mixed step
    and decodes, and the pruned branch multiplies nothing of the step's T rows."""
    ours, _ = pair
    tok = ours.tokenizer
    a, b = tok.encode(PROMPT), tok.encode("Hello world! How are you today?")
    got = {}
    for every in (False, True):
        driver = PagedDriver(ours.config, weights(ours, layout), block_size=4, every_row=every)
        sa, sb = driver.new_sequence(a), driver.new_sequence(b)
        got[every] = (driver.step([(sa, 9)]) + driver.step([(sa, len(a) - 10), (sb, len(b) - 1)])
                      + driver.step([(sa, 1), (sb, 1)], all_logits=True))
    for pruned, full in zip(got[False], got[True], strict=True):
        np.testing.assert_allclose(pruned, full, atol=2e-5, rtol=0)
    _assert_pruned_branch_multiplies_sample_rows(ours.config, weights(ours, layout))


def _assert_pruned_branch_multiplies_sample_rows(cfg, params, t: int = 32, s: int = 8):
    import jax
    import jax.extend
    import jax.numpy as jnp

    from jaxllm.attention import allocate_kv_caches
    from jaxllm.attention.kv_cache import cache_shapes, kv_cache_format
    from jaxllm.attention.metadata import AttentionMetadata
    from jaxllm.attention.xla import ragged_paged_attention_xla
    from jaxllm.models.llama import OutputRows
    from jaxllm.models.parallel import model_functions
    from jaxllm.models.rope import model_rope_table

    forward, _ = model_functions(cfg, ragged_paged_attention_xla)
    fmt = kv_cache_format("auto", jnp.float32)
    caches = allocate_kv_caches(cache_shapes(fmt, cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim))
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
    md = AttentionMetadata(i32(t), i32(4, 2), i32(4), i32(5), i32(), i32())
    out = OutputRows(i32(s), i32(), jnp.zeros((), bool))
    rope = model_rope_table(cfg, 64)
    jaxpr = jax.make_jaxpr(lambda p, c: forward(p, rope, c, i32(t), i32(t), md, out))(params, caches)
    cond = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"][-1]
    pruned = cond.params["branches"][0].jaxpr  # out.every false

    def products(jx):
        for e in jx.eqns:
            if e.primitive.name in ("dot_general", "ffi_call", "custom_call", "ragged_dot_general"):
                yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from products(sub)

    rows = [e.outvars[0].aval.shape[0] for e in products(pruned)]
    routed = {s * cfg.num_experts_per_tok} if cfg.num_experts else set()  # packed experts: a row per (token, expert)
    assert len(rows) >= 3 and set(rows) <= {s} | routed, rows
