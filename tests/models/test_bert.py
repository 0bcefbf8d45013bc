"""BERT encoders (jaxllm/models/bert.py) against HF transformers' BertModel on a tiny
random-weight folder, and the tiled segment attention against plain masked attention
(the jnp oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import make_test_model
import numpy as np
import pytest

from jaxllm.attention.kv_cache import allocate_kv_caches, cache_shapes, kv_cache_format, write_kv_cache
from jaxllm.config import ModelConfig, UnsupportedModelError
from jaxllm.loaders.hf import load_hf_params, load_hf_tokenizer
from jaxllm.models import bert
from jaxllm.models.params import ParamDecl, declare
from jaxllm.pooling_params import PoolerConfig
from jaxllm.worker.pooling_runner import PoolingRunner, PoolingRunnerConfig, metadata, pack_bert, pool


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_test_model.write_bert(tmp_path_factory.mktemp("bert"), layers=2)


def flat_batch(seqs: list[list[int]], tokens: int):
    """The pooling runner's flat batch of `seqs`, padded to `tokens`."""
    return PoolingRunner._inputs(_FakeRunner(len(seqs) + 3), seqs, tokens)


class _FakeRunner:
    """What PoolingRunner._arrays reads of its runner."""

    def __init__(self, max_num_seqs: int):
        self.rc = PoolingRunnerConfig(max_num_seqs, 1 << 12, 1 << 12, PoolerConfig("MEAN"))
        self.max_len = self.rc.max_model_len


def reference_attention(q, k, v, seg, causal=False):
    scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= jnp.arange(q.shape[0])[None, :] <= jnp.arange(q.shape[0])[:, None]
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), -1), v)


@pytest.mark.parametrize("lengths,tokens,max_len", [
    ([5, 3, 9], 32, 16),  # one tile
    ([60, 17, 100, 3, 64, 31, 88], 448, 100),  # tiles of 64 against windows narrower than the step
    ([1] * 40, 64, 8),
    ([256, 250, 9, 200, 300, 12, 1000], 2048, 1000),  # every window, the largest too
])
@pytest.mark.parametrize("causal", [False, True])
def test_segment_attention_equals_masked_attention(lengths, tokens, max_len, causal):
    rng = np.random.default_rng(0)
    a = flat_batch([[1] * n for n in lengths], tokens)
    q, k, v = (jnp.asarray(rng.standard_normal((tokens, 2, 16)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(a.seg)
    got = jax.jit(bert.segment_attention, static_argnums=(4, 5, 6))(q, k, v, seg, 16 ** -0.5, max_len, causal)
    want = reference_attention(q, k, v, seg, causal)
    n = sum(lengths)
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-6, rtol=1e-5)
    assert len(bert.key_windows(tokens, max_len)) > 1 or tokens <= 128  # windows to choose from


def step_caches(cfg: ModelConfig, tokens: int, max_num_seqs: int, block_size: int = 16):
    """A step cache for the cpu attention kernel (as the pooling runner makes one)."""
    fmt = kv_cache_format("auto", jnp.float32)
    blocks = 1 + tokens // block_size + max_num_seqs
    return allocate_kv_caches(cache_shapes(fmt, cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim))


@pytest.mark.parametrize("lengths,tokens", [([5, 3, 9], 32), ([60, 17, 100, 3, 64, 31, 88], 448), ([1] * 40, 64)])
def test_cpu_kernel_bidirectional_equals_segment_attention(lengths, tokens):
    """The C++ kernel with causal off, through a step cache, against the jnp oracle."""
    from jaxllm.attention.cpu import ragged_paged_attention_cpu

    rng = np.random.default_rng(2)
    a = flat_batch([[1] * n for n in lengths], tokens)
    q, k, v = (jnp.asarray(rng.standard_normal((tokens, 4, 32)), jnp.float32) for _ in range(3))
    cache = step_caches(ModelConfig("BertModel", 8, 128, 8, 1, 4, 4, 32, 512), tokens, len(lengths) + 3)[0]
    cache = write_kv_cache(cache, k, v, jnp.asarray(a.slots))
    got = ragged_paged_attention_cpu(q, cache.k, cache.v, jnp.asarray(a.lens), jnp.asarray(a.block_tables),
                                     jnp.asarray(a.query_start_loc), jnp.asarray(a.num_seqs), sm_scale=32 ** -0.5,
                                     causal=False)
    n = sum(lengths)
    want = reference_attention(q, k, v, jnp.asarray(a.seg))
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-6, rtol=1e-5)


def test_encoder_lowers_for_cuda(folder):
    """On a GPU the encoder attends through segment_attention (XLA): it lowers for CUDA."""
    cfg = ModelConfig.from_hf_folder(folder)
    params = jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape, jnp.bfloat16), declare(cfg),
                          is_leaf=lambda x: isinstance(x, ParamDecl))
    i32 = jax.ShapeDtypeStruct((256,), jnp.int32)
    fn = lambda p, ids, seg: bert.forward(p, cfg, ids, ids, ids, seg, jnp.int32(256), 128)[0]
    text = jax.jit(fn).trace(params, i32, i32).lower(lowering_platforms=("cuda",)).as_text()
    assert "func.func public @main" in text and "stablehlo.dot_general" in text
    assert "jaxllm_ragged_paged_attention" not in text  # no CPU custom call on the GPU path


@pytest.mark.parametrize("linear,attention", [("xla", "xla"), ("cpu", "xla"), ("cpu", "cpu")])
def test_hidden_states_equal_hf_bert(folder, linear, attention):
    """Every token's last hidden state against BertModel's on the same sequences, one
    batch of several lengths, to 1e-5: XLA's segment attention, or the C++ kernel
    bidirectional through a step cache."""
    torch = pytest.importorskip("torch")
    from transformers import BertModel

    cfg = ModelConfig.from_hf_folder(folder)
    assert cfg.is_encoder and cfg.hidden_act == "gelu" and cfg.type_vocab_size == 2
    params = load_hf_params(folder, cfg, jnp.float32)
    if linear == "cpu":
        params = pack_bert(params)
    tok = load_hf_tokenizer(folder)
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "one two three four five six " * 5]
    seqs = [tok(t)["input_ids"] for t in texts]
    a = flat_batch(seqs, 128)
    caches = step_caches(cfg, 128, len(seqs) + 3) if attention == "cpu" else None
    md = metadata(jax.tree.map(jnp.asarray, a)) if attention == "cpu" else None
    hidden, _ = jax.jit(bert.forward, static_argnums=(1, 7))(params, cfg, a.token_ids, a.positions,
                                                              np.zeros_like(a.token_ids), a.seg,
                                                              np.int32(a.num_tokens), cfg.max_position_embeddings,
                                                              caches, md)
    hf = BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    for seq, start in zip(seqs, a.starts, strict=False):
        with torch.no_grad():
            want = hf(torch.tensor([seq])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(np.asarray(hidden)[start:start + len(seq)], want, atol=1e-5, rtol=1e-5)


def test_pool_types_equal_numpy():
    rng = np.random.default_rng(1)
    lengths = [3, 1, 7]
    a = flat_batch([[1] * n for n in lengths], 16)
    h = rng.standard_normal((16, 8)).astype(np.float32)
    seg, starts, lens = (jnp.asarray(x) for x in (a.seg, a.starts, a.lens))
    got = {kind: np.asarray(pool(jnp.asarray(h), seg, starts, lens, kind)) for kind in ("MEAN", "CLS", "LAST")}
    for i, (s, n) in enumerate(zip(a.starts, lengths, strict=False)):
        np.testing.assert_allclose(got["MEAN"][i], h[s:s + n].mean(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got["CLS"][i], h[s])
        np.testing.assert_array_equal(got["LAST"][i], h[s + n - 1])
    np.testing.assert_array_equal(np.asarray(pool(jnp.asarray(h), seg, starts, lens, "ALL")), h)


def test_bert_config_refusals(folder):
    import json

    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="position_embedding_type 'relative_key'"):
        ModelConfig.from_hf_config(hf | {"position_embedding_type": "relative_key"})
    with pytest.raises(UnsupportedModelError, match="is_decoder"):
        ModelConfig.from_hf_config(hf | {"is_decoder": True})
    cfg = ModelConfig.from_hf_config(hf)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
