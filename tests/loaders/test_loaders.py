"""Loaders: safetensors (single and sharded), GGUF (llama.cpp names, permuted q/k,
quantized types, tokenizer from metadata), orbax checkpoints, and the errors a user
sees for bad inputs (each names the file and the problem)."""

import json
import shutil
import struct
from pathlib import Path

import gguf
import make_test_model
import numpy as np
import pytest

from jaxllm.config import UnsupportedModelError
from jaxllm.loaders import CheckpointError, load_model, peek_model_config
from jaxllm.loaders.checkpoint import save_checkpoint
from jaxllm.loaders.gguf_loader import GGUFFile
from tests.support.paged_driver import PagedDriver

TEXT = "The quick brown fox jumps over the lazy dog. Über café 日本語 😀"


def prompt_logits(model, ids):
    return PagedDriver(model.config, model.params).prompt_logits(ids, [len(ids)])


def copy_model(test_models_dir, tmp_path, name="llama"):
    return shutil.copytree(test_models_dir / name, tmp_path / name)


# ------------------------------------------------------------------- HF folders

def test_sharded_and_single_file_load_the_same(test_models_dir, tmp_path):
    sharded = load_model(test_models_dir / "qwen2")
    assert (test_models_dir / "qwen2" / "model.safetensors.index.json").is_file()
    single = tmp_path / "single"
    shutil.copytree(test_models_dir / "qwen2", single)
    for f in single.glob("model*.safetensors*"):
        f.unlink()
    make_test_model.save_weights(single, make_test_model._hf_tensors(test_models_dir / "qwen2"), shards=1)
    ids = sharded.tokenizer.encode(TEXT)
    np.testing.assert_array_equal(prompt_logits(sharded, ids), prompt_logits(load_model(single), ids))


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # transformers 4 and 5 forms
def test_tokenizer_and_chat_template(test_models_dir, name):
    from tokenizers import Tokenizer

    model = load_model(test_models_dir / name)
    raw = Tokenizer.from_file(str(test_models_dir / name / "tokenizer.json"))
    assert model.tokenizer.encode(TEXT) == raw.encode(TEXT).ids
    assert model.tokenizer.decode(model.tokenizer.encode(TEXT)) == TEXT
    chat = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.tokenizer.eos_token == "<|im_end|>"


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="/nonexistent/model: no such model file or folder"):
        load_model("/nonexistent/model")


def test_folder_without_weights(test_models_dir, tmp_path):
    folder = copy_model(test_models_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=f"{folder}: no model.safetensors"):
        load_model(folder)


def test_missing_shard(test_models_dir, tmp_path):
    folder = copy_model(test_models_dir, tmp_path, "qwen2")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors: shard listed in"):
        load_model(folder)


def test_unsupported_architecture(test_models_dir, tmp_path):
    folder = copy_model(test_models_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match=r"config.json: unsupported architecture FalconForCausalLM; supported: LlamaForCausalLM"):
        load_model(folder)


def test_shape_mismatch(test_models_dir, tmp_path):
    folder = copy_model(test_models_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 300}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(256, 128\), but the model config implies \(300, 128\)"):
        load_model(folder)


def test_missing_tensor(test_models_dir, tmp_path):
    folder = copy_model(test_models_dir, tmp_path)
    tensors = make_test_model._hf_tensors(folder)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    make_test_model.save_weights(folder, tensors, shards=1)
    with pytest.raises(CheckpointError, match="model.safetensors: missing tensor 'model.layers.1.self_attn.v_proj.weight'"):
        load_model(folder)


def test_truncated_safetensors(test_models_dir, tmp_path):
    folder = copy_model(test_models_dir, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{path}: cannot read"):
        load_model(folder)


# ------------------------------------------------------------------------- GGUF

@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_gguf_f32_matches_hf_folder(test_models_dir, tmp_path, name):
    """llama.cpp's conversion (permuted q/k rows, rope_freqs for Llama-3 scaling, Gemma's
    norms stored as 1 + w and its layer pattern, the tokenizer as metadata) undone
    exactly."""
    hf = load_model(test_models_dir / name)
    path = make_test_model.write_gguf(test_models_dir / name, tmp_path / f"{name}.gguf", "F32")
    ours = load_model(path)
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = hf.tokenizer.encode(TEXT)
    assert ours.tokenizer.encode(TEXT) == ids
    assert ours.tokenizer.decode(ids) == TEXT
    assert ours.tokenizer.chat_template == make_test_model.CHAT_TEMPLATE
    assert ours.tokenizer.eos_token_id == hf.tokenizer.eos_token_id
    np.testing.assert_allclose(prompt_logits(ours, ids), prompt_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype, max_rel_err", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2), ("Q4_0", 0.15), ("Q4_1", 0.12)])
def test_gguf_quantized_types_dequantize_in_place(test_models_dir, tmp_path, qtype, max_rel_err):
    """Each quantized weight lands where its float32 original was: the relative error
    is the quantization error (a misplaced row or a wrong orientation gives ~1.4)."""
    hf = load_model(test_models_dir / "llama")
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "q.gguf", qtype)
    ours = load_model(path, quantization="none")  # dequantized (Q8_0 projections are otherwise kept)
    for a, b in zip(jax_leaves(ours.params), jax_leaves(hf.params), strict=True):
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < max_rel_err


def jax_leaves(params):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(params)]


def _write_single_tensor_gguf(path, name, data, raw_dtype):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q2_K", "IQ4_NL"])
def test_gguf_k_quants_dequantize(tmp_path, qtype):
    """Types without a Python quantizer (random blocks with sane scales), read as gguf
    dequantizes them: K-quants, Q5_0 (Gemma 3 270M's q/k/gate/up), an i-quant."""
    q = gguf.GGMLQuantizationType[qtype]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(0)
    rows, blocks = 4, 2
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype in ("Q4_K", "Q5_K"):  # d, dmin are the first two f16
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    elif qtype in ("Q5_0", "IQ4_NL"):  # d first
        data[..., 0:2] = scale
    else:  # Q6_K, Q2_K: d (and dmin) last
        data[..., -2:] = scale
        data[..., -4:-2] = scale
    data = data.reshape(rows, blocks * block_bytes)
    path = _write_single_tensor_gguf(tmp_path / "k.gguf", "blk.0.ffn_down.weight", data, q)
    got = GGUFFile(path).tensor("blk.0.ffn_down.weight")
    assert got.shape == (rows, blocks * block_elems) and np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, gguf.quants.dequantize(data, q))


def test_gguf_unsupported_tensor_type(tmp_path):
    """Every type gguf dequantizes is read; one it does not (Q8_1, llama.cpp's
    activation format) is named with the supported ones."""
    from jaxllm.loaders.gguf_loader import SUPPORTED_TENSOR_TYPES

    assert {"Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "BF16"} <= set(SUPPORTED_TENSOR_TYPES)
    q = gguf.GGMLQuantizationType.Q8_1
    data = np.zeros((2, gguf.GGML_QUANT_SIZES[q][1]), np.uint8)
    path = _write_single_tensor_gguf(tmp_path / "q8_1.gguf", "token_embd.weight", data, q)
    with pytest.raises(CheckpointError, match=f"{path}: tensor 'token_embd.weight' has type Q8_1, which jaxllm "
                                              "cannot dequantize; supported: F32, F16, BF16"):
        load_model(path)


def test_gguf_unknown_tensor_type_id(tmp_path):
    path = _write_single_tensor_gguf(tmp_path / "bad.gguf", "token_embd.weight", np.zeros((2, 4), np.float32), None)
    raw = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = raw.index(name) + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", raw, type_at)[0] == 0  # F32
    struct.pack_into("<I", raw, type_at, 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{path}: cannot read GGUF file"):
        load_model(path)


def test_gguf_truncated(test_models_dir, tmp_path):
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "t.gguf", "F32")
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=f"{path}: cannot read GGUF file"):
        load_model(path)


# ------------------------------------------------------------------------ orbax

def test_orbax_checkpoint_round_trip(test_models_dir, tmp_path):
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q8_0")
    original = load_model(path)
    save_checkpoint(tmp_path / "ckpt", original.config, original.params, original.tokenizer, source=str(path))
    restored = load_model(tmp_path / "ckpt")
    assert restored.config == original.config  # rope_freqs factors included
    assert original.config.quantization == "q8_0"  # the blocks kept, and restored as they were saved
    for a, b in zip(jax_leaves(restored.params), jax_leaves(original.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert restored.tokenizer.encode(TEXT) == original.tokenizer.encode(TEXT)
    assert restored.tokenizer.chat_template == original.tokenizer.chat_template


def test_gguf_conversion_cache(test_models_dir, tmp_path, monkeypatch):
    """With a conversion cache, the first load of a GGUF keeps an orbax checkpoint and
    the next restores it (same weights, config and tokenizer); a changed file misses."""
    path = make_test_model.write_gguf(test_models_dir / "llama", tmp_path / "llama.gguf", "Q4_0")  # dequantized
    cache = tmp_path / "converted"
    first = load_model(path, conversion_cache_dir=cache)
    (entry,) = cache.iterdir()
    assert (entry / "jaxllm_checkpoint.json").is_file()
    import jaxllm.loaders

    def no_parse(*args):
        raise AssertionError("the GGUF was parsed again")

    with monkeypatch.context() as m:
        m.setattr(jaxllm.loaders, "GGUFFile", no_parse)
        second = load_model(path, conversion_cache_dir=cache)
    assert second.config == first.config
    for a, b in zip(jax_leaves(second.params), jax_leaves(first.params)):
        np.testing.assert_array_equal(a, b)
    assert second.tokenizer.encode(TEXT) == first.tokenizer.encode(TEXT)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    import os

    os.utime(path, ns=(0, 0))
    load_model(path, conversion_cache_dir=cache)
    assert len(list(cache.iterdir())) == 2


def test_the_conversion_cache_keeps_the_most_recently_used(test_models_dir, tmp_path, monkeypatch):
    """Each rewritten or reinstalled GGUF is a new conversion (its key has the file's
    mtime): storing one deletes the least recently used beyond MAX_CONVERSIONS, a load
    counting as a use, and spares those used in the last SPARE_SECONDS."""
    import os

    import jaxllm.loaders

    monkeypatch.setattr(jaxllm.loaders, "MAX_CONVERSIONS", 2)
    monkeypatch.setattr(jaxllm.loaders, "SPARE_SECONDS", 0.0)
    cache = tmp_path / "converted"
    ggufs = [make_test_model.write_gguf(test_models_dir / "llama", tmp_path / f"m{i}.gguf") for i in range(3)]
    entries = {}
    for i, path in enumerate(ggufs[:2]):
        load_model(path, conversion_cache_dir=cache)
        (entries[i],) = set(cache.iterdir()) - set(entries.values())
        os.utime(entries[i], (1000 + i, 1000 + i))  # m0 used before m1
    load_model(ggufs[0], conversion_cache_dir=cache)  # restored: m0 is now the more recent
    load_model(ggufs[2], conversion_cache_dir=cache)  # a third: m1's is deleted
    assert entries[0].is_dir() and not entries[1].exists() and len(list(cache.iterdir())) == 2
    monkeypatch.setattr(jaxllm.loaders, "SPARE_SECONDS", 3600.0)  # every entry used within the hour: none deleted
    load_model(ggufs[1], conversion_cache_dir=cache)
    assert len(list(cache.iterdir())) == 3


def test_peek_model_config_agrees_with_load_model(test_models_dir, tmp_path):
    """The engine compiles from the peeked config while the weights load: it must be
    the config load_model returns, and None whenever reading it would mean parsing."""
    import jax

    from jaxllm.models.params import abstract_params

    folder = test_models_dir / "llama"
    loaded = load_model(folder)
    assert peek_model_config(folder) == loaded.config
    spec = lambda tree: jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)
    assert spec(abstract_params(loaded.config, jax.numpy.float32)) == spec(loaded.params)

    path = make_test_model.write_gguf(folder, tmp_path / "llama.gguf", "Q4_0")  # converted (Q8_0 is kept)
    cache = tmp_path / "converted"
    assert peek_model_config(path) is None  # no conversion cache: the GGUF must be parsed
    assert peek_model_config(path, conversion_cache_dir=cache) is None  # not converted yet
    from_gguf = load_model(path, conversion_cache_dir=cache)
    assert peek_model_config(path, conversion_cache_dir=cache) == from_gguf.config


def test_packaged_models_by_name(tmp_path, monkeypatch):
    """A packaged model's name (any case) finds its file unless a path of that name
    exists; an unknown name says which names there are."""
    from jaxllm.loaders import default_model

    monkeypatch.setitem(default_model.PACKAGED_MODELS, "gemma-3-270m", lambda: tmp_path / "assembled.gguf")
    assert default_model.model_path("Gemma-3-270M") == tmp_path / "assembled.gguf"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    assert default_model.model_path("gemma-3-270m") == Path("gemma-3-270m")  # the folder wins
    with pytest.raises(FileNotFoundError, match="no-such-model: no such model file or folder .packaged models, "
                                                "by name: smollm2-135m-instruct, gemma-3-270m"):
        load_model("no-such-model")
