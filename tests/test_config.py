import json

import numpy as np
import pytest

from jaxllm.config import ModelConfig, RopeConfig, UnsupportedModelError
from jaxllm.models.rope import inverse_frequencies

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "eos_token_id": [5, 7],
}


def test_transformers4_and_5_forms_read_the_same():
    v4 = BASE | {"rope_theta": 5e5, "torch_dtype": "bfloat16",
                 "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    v5 = BASE | {"dtype": "bfloat16",
                 "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    a, b = ModelConfig.from_hf_config(v4), ModelConfig.from_hf_config(v5)
    assert a == b
    assert a.rope == RopeConfig(theta=5e5, type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)
    assert a.checkpoint_dtype == "bfloat16" and a.head_dim == 16 and a.eos_token_ids == (5, 7)
    assert ModelConfig.from_hf_config(a.to_hf_config()) == a  # round trip through the v5 form


def test_architecture_flags():
    qwen2 = ModelConfig.from_hf_config(BASE | {"architectures": ["Qwen2ForCausalLM"]})
    qwen3 = ModelConfig.from_hf_config(BASE | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    mistral = ModelConfig.from_hf_config(BASE | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert (qwen2.qkv_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.q_size) == (False, True, 128)
    assert mistral.sliding_window == 4096
    assert ModelConfig.from_hf_config(BASE).sliding_window is None


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedModelError, match=r"GPTNeoXForCausalLM.*supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_hf_config(BASE | {"architectures": ["GPTNeoXForCausalLM"]})


def test_unsupported_rope_type_and_missing_field():
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        ModelConfig.from_hf_config(BASE | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    broken = dict(BASE)
    del broken["hidden_size"]
    with pytest.raises(UnsupportedModelError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf_config(broken)


def test_llama3_rope_matches_transformers():
    import torch  # noqa: F401  (transformers' rope init needs torch)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = inverse_frequencies(ModelConfig.from_hf_config(BASE | {"hidden_size": 512, "rope_parameters": params}).rope, 128)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)


def test_gguf_metadata():
    meta = {
        "general.architecture": "llama", "llama.block_count": 30, "llama.context_length": 8192,
        "llama.embedding_length": 576, "llama.feed_forward_length": 1536, "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3, "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 49152,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1,
    }
    cfg = ModelConfig.from_gguf_metadata(meta)
    assert (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads, cfg.rope.theta, cfg.eos_token_ids) == (30, 64, 3, 1e5, (2,))
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gemma2'"):
        ModelConfig.from_gguf_metadata(meta | {"general.architecture": "gemma2"})


def test_from_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="config.json: not valid JSON"):
        ModelConfig.from_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_hf_folder(tmp_path).num_layers == 2


def test_the_serve_cli_is_generated_from_engine_config():
    """Every EngineConfig field is a flag with its default, help and choices; nothing
    is restated, so a new option reaches the CLI by being declared once."""
    import dataclasses

    from jaxllm.engine.config import EngineConfig
    from jaxllm.serve import engine_config, parse_args

    assert engine_config(parse_args([])) == EngineConfig()
    args = parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB",
                       "--attention-backend", "xla", "--max-model-len", "512", "--port", "9"])
    assert engine_config(args) == EngineConfig(max_num_seqs=8, enable_prefix_caching=False, kv_cache_memory="1GiB",
                                               attention_backend="xla", max_model_len=512)
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f.name
    with pytest.raises(SystemExit):
        parse_args(["--linear-backend", "onednn"])
    with pytest.raises(ValueError, match="linear_backend: unknown 'onednn'; choose one of auto, xla, cpu"):
        EngineConfig(linear_backend="onednn")
