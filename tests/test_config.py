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
    with pytest.raises(UnsupportedModelError, match=r"GPTNeoXForCausalLM.*supported: LlamaForCausalLM, MistralForCausalLM, "
                                                     r"Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM"):
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
    with pytest.raises(UnsupportedModelError, match=r"unsupported GGUF architecture 'phi3'; supported: \['gemma2'"):
        ModelConfig.from_gguf_metadata(meta | {"general.architecture": "phi3"})


GEMMA3 = BASE | {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 8, "head_dim": 32,
                 "sliding_window": 512, "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh"}


def test_gemma3_transformers4_and_5_forms():
    """Two RoPEs (the full layers' with its scaling, the sliding layers' plain), the
    layer pattern (one full layer in six unless `layer_types` says), Gemma's norms,
    activation, scales; and back through to_hf_config."""
    v4 = GEMMA3 | {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    v5 = GEMMA3 | {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                   "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2}
    a, b = ModelConfig.from_hf_config(v4), ModelConfig.from_hf_config(v5)
    assert a == b
    assert a.rope == RopeConfig(theta=1e6, type="linear", factor=8.0) and a.rope_local == RopeConfig(theta=1e4)
    assert [a.layer_window(i) for i in range(8)] == [512] * 5 + [None] + [512] * 2
    assert (a.norm_offset, a.sandwich_norms, a.scale_embeddings, a.qk_norm, a.tie_word_embeddings) == (1.0, True, True,
                                                                                                      True, True)
    assert a.hidden_act == "gelu_pytorch_tanh" and a.sm_scale == 24**-0.5 and a.final_logit_softcap is None
    assert ModelConfig.from_hf_config(a.to_hf_config()) == a


def test_gemma2_and_qwen2_sliding_layers():
    g2 = ModelConfig.from_hf_config(GEMMA3 | {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
                                              "final_logit_softcapping": 30.0, "num_hidden_layers": 4})
    assert [g2.is_sliding(i) for i in range(4)] == [True, False, True, False] and g2.rope_local is None
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.qk_norm) == (50.0, 30.0, False)
    assert ModelConfig.from_hf_config(g2.to_hf_config()) == g2
    # Qwen2's use_sliding_window: the layers from max_window_layers on slide (HF's rule)
    q = ModelConfig.from_hf_config(BASE | {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
                                           "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2})
    assert [q.layer_window(i) for i in range(4)] == [None, None, 64, 64]
    assert ModelConfig.from_hf_config(q.to_hf_config()) == q
    off = ModelConfig.from_hf_config(BASE | {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
                                             "sliding_window": 64})
    assert off.layer_window(0) is None


def test_unsupported_activation_layer_type_and_bidirectional():
    with pytest.raises(UnsupportedModelError, match="hidden activation 'relu' is not supported; supported: silu, "
                                                    "gelu_pytorch_tanh"):
        ModelConfig.from_hf_config(BASE | {"hidden_act": "relu"})
    with pytest.raises(UnsupportedModelError, match="layer type.* chunked_attention not supported"):
        ModelConfig.from_hf_config(GEMMA3 | {"layer_types": ["chunked_attention"] * 8})
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config(GEMMA3 | {"use_bidirectional_attention": True})


def test_gemma3_gguf_metadata_takes_llama_cpp_defaults():
    """What llama.cpp hard-codes for Gemma 3 and does not store: five sliding layers in
    six, the local RoPE base 10,000, the query scale 1 / sqrt(head_dim) (27B: hidden /
    heads)."""
    meta = {
        "general.architecture": "gemma3", "gemma3.block_count": 18, "gemma3.context_length": 32768,
        "gemma3.embedding_length": 640, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256, "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.eos_token_id": 1,
    }
    cfg = ModelConfig.from_gguf_metadata(meta)
    assert [cfg.is_sliding(i) for i in range(12)] == ([True] * 5 + [False]) * 2
    assert (cfg.rope.theta, cfg.rope_local.theta, cfg.query_pre_attn_scalar, cfg.head_dim) == (1e6, 1e4, 256, 256)
    assert cfg.qk_norm and cfg.norm_offset == 1.0 and cfg.hidden_act == "gelu_pytorch_tanh"
    big = ModelConfig.from_gguf_metadata(meta | {"gemma3.block_count": 62, "gemma3.embedding_length": 5376,
                                                 "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128})
    assert big.query_pre_attn_scalar == 168


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


def test_mixture_of_experts_configs():
    """Mixtral: every layer top-k of `num_local_experts` of `intermediate_size`,
    renormalized; Qwen2-MoE: `moe_intermediate_size`, a shared expert, dense layers
    from `mlp_only_layers` and `decoder_sparse_step`, q/k/v biases; Qwen3-MoE: q/k
    norms, `norm_topk_prob`; each round-trips through to_hf_config."""
    mixtral = ModelConfig.from_hf_config(BASE | {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                                 "num_experts_per_tok": 2, "sliding_window": None})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 128)
    assert mixtral.norm_topk_prob and mixtral.is_moe(0) and mixtral.sliding_window is None
    qwen2 = ModelConfig.from_hf_config(BASE | {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 4,
                                               "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
                                               "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2,
                                               "mlp_only_layers": [3]})
    assert qwen2.qkv_bias and not qwen2.norm_topk_prob and qwen2.shared_expert_intermediate_size == 96
    assert [qwen2.is_moe(i) for i in range(4)] == [False, True, False, False]  # sparse step 2; layer 3 listed
    qwen3 = ModelConfig.from_hf_config(BASE | {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                                               "num_experts_per_tok": 8, "moe_intermediate_size": 16,
                                               "norm_topk_prob": True})
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.shared_expert_intermediate_size == 0
    for cfg in (mixtral, qwen2, qwen3):
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 must be in 1..num_experts=8"):
        ModelConfig.from_hf_config(BASE | {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                           "num_experts_per_tok": 9})


def test_the_readme_options_table_is_current():
    """README's options table is generated from the options' own help
    (scripts/options_table.py); a new or changed option without a fresh table fails."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "scripts" / "options_table.py"), "--check"], cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README's options table is stale: run scripts/options_table.py\n{result.stderr}"
