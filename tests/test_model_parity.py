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
from tests.conftest import ARCHITECTURES
from tests.paged_driver import PagedDriver

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is Paris; one two"
TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHITECTURES)
def pair(request, test_models_dir):
    path = test_models_dir / request.param
    ours = load_model(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


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
    for chunks in ([len(ids)], [5, 7, 1, len(ids) - 13], [1] * len(ids)):
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
    """dtype="bfloat16" (the GPU default) runs the same forward in bfloat16: params and
    KV cache are bfloat16, logits stay close to float32's."""
    f32 = load_model(test_models_dir / "llama", dtype="float32")
    bf16 = load_model(test_models_dir / "llama", dtype="bfloat16")
    assert bf16.params.layers[0].wqkv.dtype == np.dtype("bfloat16")
    ids = f32.tokenizer.encode(PROMPT)
    driver = PagedDriver(bf16.config, bf16.params, block_size=8)
    assert driver.caches[0].k.dtype == np.dtype("bfloat16")
    got = driver.prompt_logits(ids, [7, len(ids) - 7])
    ref = PagedDriver(f32.config, f32.params, block_size=8).prompt_logits(ids, [len(ids)])
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()  # bfloat16 keeps ~3 significant digits
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9
