"""Pooling engines (runner pooling): all-MiniLM-L6-v2's embeddings through LLM.embed
against sentence-transformers itself (the oracle), LLM.score and LLM.encode, the poolers
a sentence-transformers folder declares on a tiny random BERT against numpy over HF's
hidden states, and the refusals (each a ValueError naming the field)."""

from __future__ import annotations

import make_test_model
import numpy as np
import pytest

from jaxllm import LLM, PoolingParams
from jaxllm.loaders.default_model import all_minilm_l6_v2_path
from tests.support.llm import LAZY

PARITY = 0.99999  # cosine to sentence-transformers' embeddings (issue 61)
# Heavier variants (each its own engine) run with -m slow: the folder's MEAN and ALL poolers and the
# Qwen3-shaped decoder stay in the default run (conftest.py marks these)
SLOW_CASES = ("CLS", "pooler2", "llama-", "gemma3-")

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
         "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
         "Someone in a gorilla costume is playing a set of drums.", "ok"]
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the band plays on."] * 30)  # > 256 tokens


@pytest.fixture(scope="module")
def minilm_folder():
    return all_minilm_l6_v2_path()


@pytest.fixture(scope="module")
def sentence_transformer(minilm_folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder), device="cpu")


@pytest.fixture(scope="module")
def minilm(minilm_folder, tmp_path_factory):
    # backends auto (measured: the pooling runner's plan, without warm-up too), steps of up to 256 tokens (the
    # model's length: its longest input in one step) and 8 sequences: 9 buckets, not 13, compiled as the steps
    # meet them, the plans timed at 256 tokens
    return LLM(str(minilm_folder), max_num_batched_tokens=256, max_num_seqs=8,
               compilation_cache_dir=str(tmp_path_factory.mktemp("xla")), progress=False, **LAZY)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_minilm_embeddings_equal_sentence_transformers(minilm, sentence_transformer):
    """Batched, one at a time, and a max-length input (truncated as sentence-transformers
    truncates: to 256 tokens, [SEP] kept), all normalized, to cosine >= 0.99999."""
    core = minilm.llm_engine.core
    assert (core.pooler.pooling_type, core.pooler.normalize, core.max_model_len) == ("MEAN", True, 256)
    assert len(core.runner.measured) == len(core.runner.plans) > 1  # chosen by measurement, warm-up or not
    texts = [*TEXTS, LONG]
    want = sentence_transformer.encode(texts, batch_size=32)
    batched = np.array([o.outputs.embedding for o in minilm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)])
    assert cosines(batched, want).min() >= PARITY
    np.testing.assert_allclose(np.linalg.norm(batched, axis=-1), 1, atol=1e-6)
    alone = minilm.embed(TEXTS[0], use_tqdm=False)
    assert len(alone) == 1 and cosines(alone[0].outputs.embedding, want[0]) >= PARITY
    long_out = minilm.embed(LONG, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(long_out.prompt_token_ids) == 256 and long_out.prompt_token_ids[-1] == 102  # [SEP]


def test_minilm_score_and_encode(minilm, sentence_transformer):
    scores = minilm.score(TEXTS[0], TEXTS[1:4], use_tqdm=False)
    want = sentence_transformer.similarity(sentence_transformer.encode(TEXTS[:1]),
                                           sentence_transformer.encode(TEXTS[1:4])).numpy()[0]
    np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=1e-5)
    pairwise = minilm.score(TEXTS[:2], TEXTS[2:4], use_tqdm=False)
    assert len(pairwise) == 2
    encoded = minilm.encode(TEXTS[:2], use_tqdm=False)  # the mean-pooled state, not normalized
    assert encoded[0].outputs.data.shape == (384,) and abs(np.linalg.norm(encoded[0].outputs.data) - 1) > 0.1
    want = [t.numpy().mean(0) for t in sentence_transformer.encode(TEXTS[:2], output_value="token_embeddings")]
    np.testing.assert_allclose(np.stack([e.outputs.data for e in encoded]), want, atol=1e-5)  # before Normalize
    raw = minilm.embed(TEXTS[:1], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(raw, encoded[0].outputs.data, atol=2e-6)  # another batch: other roundings


def test_minilm_refusals(minilm):
    with pytest.raises(ValueError, match="^prompt: .*256 tokens.*truncate_prompt_tokens"):
        minilm.embed(LONG, use_tqdm=False)
    with pytest.raises(ValueError, match="^dimensions: this model does not support matryoshka"):
        minilm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params: .*served for pooling.*--runner generate"):
        minilm.generate("hi")
    with pytest.raises(ValueError, match="^task: token_embed needs .*pooling_type ALL"):
        minilm.encode("hi", pooling_task="token_embed", use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        minilm.embed([[]], use_tqdm=False)
    assert not minilm.llm_engine.has_unfinished_requests()  # nothing was queued
    assert len(minilm.embed(TEXTS[:3], use_tqdm=False)) == 3  # and the engine serves on


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return make_test_model.write_bert(tmp_path_factory.mktemp("bert"), pooling="mean", max_seq_length=48,
                                      matryoshka=True)


def hf_hidden_states(folder, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("pooler", [None, '{"pooling_type": "CLS", "normalize": false}', {"pooling_type": "LAST"},
                                    {"pooling_type": "ALL"}])
def test_poolers_equal_numpy_over_hf(bert_folder, pooler, tmp_path):
    """The folder's MEAN (sentence-transformers modules), or --pooler-config's CLS, LAST
    and ALL, each from HF BertModel's hidden states; max_model_len from max_seq_length."""
    llm = LLM(str(bert_folder), runner="pooling", pooler_config=pooler, max_num_batched_tokens=64,
              max_num_seqs=8, compilation_cache_dir=str(tmp_path), linear_backend="xla", attention_backend="cpu",
              progress=False, **LAZY)  # backends named: nothing measured (the MiniLM engine above measures)
    core = llm.llm_engine.core
    assert core.max_model_len == 48
    kind = core.pooler.pooling_type
    texts = ["the quick brown fox", "hello world! how are you today?", "one two three " * 4]
    task = "token_embed" if kind == "ALL" else "encode"
    outputs = llm.encode(texts, pooling_task=task, use_tqdm=False)
    for out in outputs:
        h = hf_hidden_states(bert_folder, out.prompt_token_ids)
        per_token = h / np.linalg.norm(h, axis=-1, keepdims=True)  # token_embed: each normalized (the folder says)
        want = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1], "ALL": per_token}[kind]
        np.testing.assert_allclose(out.outputs.data, want, atol=1e-5, rtol=1e-5)
    if kind == "MEAN":  # embed: normalized (the folder's Normalize module); matryoshka: cut first
        emb = llm.embed(texts[0], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
        want = outputs[0].outputs.data[:16]
        np.testing.assert_allclose(emb, want / np.linalg.norm(want), atol=1e-6)
        with pytest.raises(ValueError, match="^dimensions: 65 is not one this model supports"):
            llm.embed("hi", PoolingParams(dimensions=65), use_tqdm=False)


def test_runner_choices_are_refused_with_the_fix(bert_folder, tmp_path):
    """(An embedding request to a generating engine: tests/entrypoints/test_server.py.)"""
    with pytest.raises(ValueError, match="^runner: BertModel is an encoder.*--runner pooling"):
        LLM(str(bert_folder), runner="generate", compilation_cache_dir=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match="^pooler_config: unknown pooling_type 'MAX'"):
        LLM(str(bert_folder), pooler_config='{"pooling_type": "max"}')
    with pytest.raises(ValueError, match="^pooler_config: unknown field.*kind; known: dimensions, normalize"):
        LLM(str(bert_folder), pooler_config='{"kind": "MEAN"}')
    with pytest.raises(ValueError, match="^pooler_config: not JSON"):
        LLM(str(bert_folder), pooler_config="{MEAN")
    with pytest.raises(ValueError, match="^pooler_config: only with the pooling runner"):
        LLM(str(bert_folder), runner="generate", pooler_config={"pooling_type": "CLS"})
    with pytest.raises(ValueError, match="^runner: pooling is not yet served with tensor_parallel_size > 1"):
        LLM(str(bert_folder), tensor_parallel_size=2, compilation_cache_dir=str(tmp_path), progress=False)


# ----------------------------------------------------------------- decoder embedders

@pytest.mark.parametrize("arch,pooler", [("qwen3", None), ("llama", {"pooling_type": "MEAN"}),
                                         ("gemma3", {"pooling_type": "LAST", "normalize": False})])
def test_decoder_embedders_equal_hf_hidden_states(test_models_dir, arch, pooler, tmp_path):
    """A decoder served for pooling (--runner pooling, --convert embed by default): its
    final-normed hidden states pooled, against transformers' AutoModel (a Qwen3-shaped
    model as Qwen3-Embedding is served: the last token, normalized)."""
    import torch
    from transformers import AutoModel

    folder = test_models_dir / arch
    llm = LLM(str(folder), runner="pooling", pooler_config=pooler, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=128, compilation_cache_dir=str(tmp_path), linear_backend="cpu",
              attention_backend="cpu", progress=False, **LAZY)
    pooler = llm.llm_engine.core.pooler
    texts = ["Instruct: find the capital\nQuery: France", "Hello world! How are you today? " * 3, "one"]
    outputs = llm.embed(texts, use_tqdm=False)
    hf = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    for out in outputs:
        with torch.no_grad():
            h = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0].numpy()
        want = h.mean(0) if pooler.pooling_type == "MEAN" else h[-1]
        want = want / np.linalg.norm(want) if pooler.normalize else want
        got = np.asarray(out.outputs.embedding)
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.slow  # ~30 s; the default run covers decoder embedders with the random models above
def test_smollm2_as_an_embedder_equals_hf_on_its_weights(tmp_path):
    """The default model's file (Q4_1 blocks kept) served for pooling: its last token's
    normalized hidden state against transformers' LlamaModel on the same weights
    dequantized. SmolLM2's hidden states are not trained embeddings: the path is the point."""
    import torch
    from transformers import AutoModel

    from jaxllm.loaders import load_model
    from jaxllm.loaders.hf import save_hf_folder

    llm = LLM(runner="pooling", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
              compilation_cache_dir=str(tmp_path / "xla"), progress=False, **LAZY)
    assert llm.llm_engine.core.pooler.pooling_type == "LAST"
    texts = ["The capital of France is Paris.", "def fibonacci(n):"]
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    model = load_model(None)
    folder = save_hf_folder(tmp_path / "hf", model.config, model.params, model.tokenizer)
    hf = AutoModel.from_pretrained(folder).eval()
    for text, vec in zip(texts, got, strict=True):
        with torch.no_grad():
            h = hf(torch.tensor([model.tokenizer.encode(text)])).last_hidden_state[0, -1].numpy()
        assert cosines(vec, h) >= 0.99999


@pytest.mark.slow  # ~1-2 min: Gemma 3 270M's 262k vocabulary exported for transformers
def test_gemma3_270m_as_an_embedder_equals_hf_on_its_weights(tmp_path):
    """Gemma 3 270M (Q4_K_M, its blocks kept; sliding and full layers) served for
    pooling: the last token's normalized hidden state against transformers' on the same
    weights dequantized (float32; Gemma's residual stream drifts in float32: cosine)."""
    import torch
    from transformers import AutoModel

    from jaxllm.loaders import load_model
    from jaxllm.loaders.hf import save_hf_folder

    llm = LLM("gemma-3-270m", runner="pooling", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
              compilation_cache_dir=str(tmp_path / "xla"), progress=False, **LAZY)
    texts = ["The capital of France is Paris.", " ".join(f"item {i} weighs {i * 7 % 31} grams" for i in range(20))]
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    model = load_model("gemma-3-270m")
    folder = save_hf_folder(tmp_path / "hf", model.config, model.params, model.tokenizer)
    del model
    hf = AutoModel.from_pretrained(folder).eval()
    tok = llm.get_tokenizer()
    for text, vec in zip(texts, got, strict=True):
        with torch.no_grad():
            h = hf(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1].numpy()
        assert cosines(vec, h) >= 0.9999
