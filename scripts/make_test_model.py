#!/usr/bin/env python
"""Write tiny random-weight HF model folders, one per supported architecture, and
random-weight models of real shapes (`llama-3.2-1b`, `llama-3.1-8b`: bfloat16, for
timing on a GPU; not in the default set).

Each folder holds config.json, model.safetensors (or shards + index),
tokenizer.json (a byte-level BPE trained here on a small built-in corpus) and a ChatML
chat template, in the transformers 4 form (template in tokenizer_config.json,
rope_theta/rope_scaling, torch_dtype) or the transformers 5 form (chat_template.jinja,
rope_parameters, dtype). Uses numpy + safetensors + tokenizers only.

    python scripts/make_test_model.py OUT_DIR [--arch llama,qwen2]
    python scripts/make_test_model.py OUT_DIR --arch llama-3.1-8b     # 16 GB of bfloat16
    python scripts/make_test_model.py OUT_DIR --arch bert             # a BERT encoder (embeddings)
    python scripts/make_test_model.py OUT_DIR --arch llava,gemma3_vlm  # vision-language (HF transformers + torch)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache keeps keys and values
in fixed-size blocks; each sequence has a block table. Continuous batching schedules tokens
every step under a budget, mixing prefill chunks with decodes. The capital of France is Paris;
the capital of Italy is Rome; the capital of Japan is Tokyo. One, two, three, four, five, six,
seven, eight, nine, ten. 0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; : ' " # $ % & @
Hello world! How are you today? I am fine, thank you. Über naïve café — 日本語 テキスト 😀 ñ ü é.
def forward(params, x): return x @ params["w"]  # code, too
"""

# name -> (config.json form, architecture, extra config fields)
ARCHITECTURES = {
    # Llama with Llama-3 RoPE scaling and tied embeddings (as SmolLM2), transformers 4 form.
    "llama": dict(
        form=4, arch="LlamaForCausalLM", model_type="llama", hidden=128, heads=4, kv_heads=2, head_dim=32,
        extra={"tie_word_embeddings": True, "rope_theta": 10000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    ),
    # Mistral with a short sliding window, so the tests cross it; transformers 5 form.
    "mistral": dict(
        form=5, arch="MistralForCausalLM", model_type="mistral", hidden=128, heads=4, kv_heads=2, head_dim=32,
        extra={"sliding_window": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    # Qwen2: q/k/v biases, untied; sharded safetensors; transformers 4 form.
    "qwen2": dict(
        form=4, arch="Qwen2ForCausalLM", model_type="qwen2", hidden=128, heads=4, kv_heads=2, head_dim=32,
        extra={"rope_theta": 1000000.0, "use_sliding_window": False}, shards=2,
    ),
    # Mixtral: top-2 of 4 experts in every layer, renormalized; transformers 4 form
    # (per-expert tensors, block_sparse_moe names, as the hub stores them).
    "mixtral": dict(
        form=4, arch="MixtralForCausalLM", model_type="mixtral", hidden=128, heads=4, kv_heads=2, head_dim=32,
        intermediate=64, extra={"num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1000000.0},
    ),
    # Qwen2-MoE: q/k/v biases, top-2 of 4 experts not renormalized, a sigmoid-gated
    # shared expert, the second layer dense (mlp_only_layers); transformers 4 form.
    "qwen2_moe": dict(
        form=4, arch="Qwen2MoeForCausalLM", model_type="qwen2_moe", hidden=128, heads=4, kv_heads=2, head_dim=32,
        extra={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1],
               "decoder_sparse_step": 1, "rope_theta": 1000000.0, "use_sliding_window": False},
    ),
    # Qwen3-MoE: q/k norms, top-3 of 8 experts renormalized; transformers 5 form.
    "qwen3_moe": dict(
        form=5, arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", hidden=96, heads=4, kv_heads=1, head_dim=32,
        extra={"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True,
               "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
    # Qwen3: q/k RMSNorm, head_dim independent of hidden size, GQA 4; transformers 5 form.
    "qwen3": dict(
        form=5, arch="Qwen3ForCausalLM", model_type="qwen3", hidden=96, heads=4, kv_heads=1, head_dim=32,
        extra={"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "use_sliding_window": False},
    ),
    # Gemma 3: sliding and full layers alternating (the real pattern is 5:1; 2 layers here
    # hold one of each), a RoPE per layer type (linear scaling on the full ones), q/k
    # norms, a query scale that is not head_dim's, tied embeddings; transformers 5 form.
    "gemma3": dict(
        form=5, arch="Gemma3ForCausalLM", model_type="gemma3_text", hidden=128, heads=4, kv_heads=1, head_dim=32,
        pattern=2, max_position_embeddings=4096,  # the hybrid KV cache's 4k-token test
        extra={"tie_word_embeddings": True, "sliding_window": 12, "query_pre_attn_scalar": 24,
                          "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                          "attn_logit_softcapping": None,
                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                 "rope_theta": 1000000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    ),
    # Gemma 2: soft-capped attention scores and logits (caps small enough to bite on
    # random weights), sliding and full layers alternating; transformers 4 form.
    "gemma2": dict(
        form=4, arch="Gemma2ForCausalLM", model_type="gemma2", hidden=128, heads=4, kv_heads=2, head_dim=32,
        pattern=2, extra={"tie_word_embeddings": True, "sliding_window": 16, "query_pre_attn_scalar": 32,
                          "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 2.0,
                          "final_logit_softcapping": 8.0, "rope_theta": 10000.0},
    ),
}
GEMMA = ("gemma2", "gemma3_text")

# Real shapes (the published configs' sizes; random weights, the tiny tokenizer: feed
# them token ids). Keys beyond ARCHITECTURES': the sizes the tiny models take from
# write_model's arguments, and the weights' dtype.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
REAL_SHAPES = {
    "llama-3.2-1b": dict(
        form=4, arch="LlamaForCausalLM", model_type="llama", hidden=2048, heads=32, kv_heads=8, head_dim=64,
        vocab=128256, intermediate=8192, layers=16, dtype="bfloat16", max_position_embeddings=131072,
        extra={"tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE | {"factor": 32.0}},
    ),
    "llama-3.1-8b": dict(
        form=4, arch="LlamaForCausalLM", model_type="llama", hidden=4096, heads=32, kv_heads=8, head_dim=128,
        vocab=128256, intermediate=14336, layers=32, dtype="bfloat16", max_position_embeddings=131072,
        extra={"rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE | {"factor": 8.0}}, shards=4,
    ),
}


def train_tokenizer(vocab_size: int = 512, extra_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE over CORPUS; `extra_tokens` get ids of their own (after the special
    ones) and stay in decoded text, as Qwen3's <think> and <tool_call> do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    if extra_tokens:  # not special: decoding keeps them
        saved = json.loads(tok.to_str())
        for added in saved["added_tokens"]:
            added["special"] = added["content"] in SPECIAL_TOKENS
        tok = Tokenizer.from_str(json.dumps(saved))
    return tok


def random_weights(spec: dict, vocab: int, intermediate: int, layers: int, rng: np.random.Generator,
                   dtype: str = "float32") -> dict:
    """HF-named random tensors of `dtype` (float32 or bfloat16: each tensor converted
    as it is drawn, so an 8B model never exists in float32)."""
    import ml_dtypes

    real = np.float32 if dtype == "float32" else {"bfloat16": ml_dtypes.bfloat16}[dtype]
    d, hd = spec["hidden"], spec["head_dim"]
    q, kv = spec["heads"] * hd, spec["kv_heads"] * hd

    def mat(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(real)

    gemma = spec["model_type"] in GEMMA
    offset = 1.0 if gemma else 0.0  # Gemma's norms scale by 1 + w: the same scales, stored less one

    def norm(n: int, scale: float = 1.0) -> np.ndarray:
        return ((1.0 + 0.1 * rng.standard_normal(n)) * scale - offset).astype(real)

    # Small embeddings keep the layers' contribution dominant (no "repeat the input token"
    # attractor; Gemma scales its up by sqrt(hidden), so they are drawn that much smaller);
    # a tied head is scaled up in the final norm (as much more) so logits stay well separated.
    tied = bool(spec["extra"].get("tie_word_embeddings"))
    shrink = np.sqrt(d) if gemma else 1.0
    w = {"model.embed_tokens.weight": (0.1 / shrink * rng.standard_normal((vocab, d))).astype(real),
         "model.norm.weight": norm(d, 5.0 * shrink if tied else 1.0)}
    if not tied:
        w["lm_head.weight"] = (0.5 * rng.standard_normal((vocab, d))).astype(real)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(q, d)
        w[p + "self_attn.k_proj.weight"] = mat(kv, d)
        w[p + "self_attn.v_proj.weight"] = mat(kv, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, q)
        if i in moe_layers(spec, layers):
            w.update(_moe_weights(spec, p, d, intermediate, mat))
        else:
            w[p + "mlp.gate_proj.weight"] = mat(intermediate, d)
            w[p + "mlp.up_proj.weight"] = mat(intermediate, d)
            w[p + "mlp.down_proj.weight"] = mat(d, intermediate)
        if spec["model_type"] in ("qwen2", "qwen2_moe"):
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{n}_proj.bias"] = (0.1 * rng.standard_normal(size)).astype(real)
        if spec["model_type"] in ("qwen3", "gemma3_text", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        if gemma:  # post_attention_layernorm is the attention's output norm; the MLP's input norm its own
            w[p + "pre_feedforward_layernorm.weight"] = norm(d)
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
    return w


def moe_layers(spec: dict, layers: int) -> list[int]:
    """The layers of a MoE spec whose MLP is a mixture of experts."""
    extra = spec["extra"]
    if "num_local_experts" not in extra and "num_experts" not in extra:
        return []
    return [i for i in range(layers) if i not in extra.get("mlp_only_layers", [])]


def _moe_weights(spec: dict, p: str, d: int, intermediate: int, mat) -> dict:
    """A MoE layer's router, per-expert MLPs (the hub's names) and shared expert. The
    router's logits are drawn large so the top-k choices are well separated."""
    extra, w = spec["extra"], {}
    if spec["model_type"] == "mixtral":
        e, f, moe = extra["num_local_experts"], intermediate, p + "block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        e, f, moe = extra["num_experts"], extra["moe_intermediate_size"], p + "mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    w[moe + "gate.weight"] = 4.0 * mat(e, d)
    for x in range(e):
        gate, up, down = (f"{moe}experts.{x}.{n}.weight" for n in names)
        w[gate], w[up], w[down] = mat(f, d), mat(f, d), mat(d, f)
    fs = extra.get("shared_expert_intermediate_size", 0)
    if fs:
        for n, shape in (("gate_proj", (fs, d)), ("up_proj", (fs, d)), ("down_proj", (d, fs))):
            w[f"{moe}shared_expert.{n}.weight"] = mat(*shape)
        w[moe + "shared_expert_gate.weight"] = mat(1, d)
    return w


def save_weights(folder: Path, weights: dict, shards: int) -> None:
    if shards <= 1:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(a.nbytes for a in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


QWEN3_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def write_model(out: Path, name: str, seed: int = 0, layers: int | None = None, intermediate: int = 256,
                max_position_embeddings: int = 1024, chat_template: str | None = None,
                extra_tokens: tuple[str, ...] = ()) -> Path:
    spec = ARCHITECTURES.get(name) or REAL_SHAPES[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(extra_tokens=extra_tokens)
    vocab = spec.get("vocab", tok.get_vocab_size())
    intermediate = spec.get("intermediate", intermediate)
    layers = layers or spec.get("layers", 2)  # given, else the real shape's, else 2
    max_position_embeddings = spec.get("max_position_embeddings", max_position_embeddings)
    dtype = spec.get("dtype", "float32")
    eos = tok.token_to_id("<|im_end|>")
    config = {
        "architectures": [spec["arch"]],
        "model_type": spec["model_type"],
        "vocab_size": vocab,
        "hidden_size": spec["hidden"],
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"],
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": eos,
        "tie_word_embeddings": False,
        ("torch_dtype" if spec["form"] == 4 else "dtype"): dtype,
    } | spec["extra"]
    if "pattern" in spec:  # Gemma: one full layer every `pattern`, the others sliding
        config["layer_types"] = ["sliding_attention" if (i + 1) % spec["pattern"] else "full_attention"
                                 for i in range(layers)]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    save_weights(folder, random_weights(spec, vocab, intermediate, layers, rng, dtype), spec.get("shards", 1))

    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
    }
    if spec["form"] == 4:
        tok_config["chat_template"] = chat_template or CHAT_TEMPLATE
    else:
        (folder / "chat_template.jinja").write_text(chat_template or CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    )
    return folder


def write_reasoning_model(out: Path, seed: int = 0) -> Path:
    """The qwen3 test model (random weights) with Qwen3's chat template (thinking,
    enable_thinking, tools) and its <think>, </think>, <tool_call>, </tool_call> tokens,
    in out/qwen3."""
    template = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
    return write_model(out, "qwen3", seed=seed, chat_template=template, extra_tokens=QWEN3_TOKENS,
                       max_position_embeddings=4096)


BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_wordpiece(vocab_size: int = 400) -> Tokenizer:
    """A BERT-style tokenizer: lower-cased WordPiece, [CLS] ... [SEP] around each text."""
    from tokenizers import normalizers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([CORPUS] * 4, trainer=trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return tok


def write_bert(out: Path, name: str = "bert", seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
               intermediate: int = 128, max_position_embeddings: int = 128, pooling: str | None = None,
               normalize: bool = True, max_seq_length: int | None = None, matryoshka: bool = False) -> Path:
    """A tiny random-weight HF BertModel folder (BertModel's tensor names, a WordPiece
    tokenizer). `pooling` ("mean", "cls", "lasttoken") makes it a sentence-transformers
    folder too: modules.json with that Pooling module (and Normalize where `normalize`),
    sentence_bert_config.json's `max_seq_length`; `matryoshka`: config.json says
    is_matryoshka."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_wordpiece()
    vocab = tok.get_vocab_size()
    config = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": intermediate,
              "hidden_act": "gelu", "max_position_embeddings": max_position_embeddings, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "pad_token_id": 0, "position_embedding_type": "absolute",
              "torch_dtype": "float32"} | ({"is_matryoshka": True} if matryoshka else {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    mat = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
    vec = lambda n, scale=0.1: (rng.standard_normal(n) * scale).astype(np.float32)
    weights = {"embeddings.word_embeddings.weight": mat(vocab, hidden) * 4,
               "embeddings.position_embeddings.weight": mat(max_position_embeddings, hidden) * 4,
               "embeddings.token_type_embeddings.weight": mat(2, hidden) * 4,
               "embeddings.LayerNorm.weight": 1 + vec(hidden), "embeddings.LayerNorm.bias": vec(hidden)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in ("query", "key", "value"):
            weights[p + f"attention.self.{part}.weight"] = mat(hidden, hidden)
            weights[p + f"attention.self.{part}.bias"] = vec(hidden)
        for name_, (o, n) in {"attention.output.dense": (hidden, hidden), "intermediate.dense": (intermediate, hidden),
                              "output.dense": (hidden, intermediate)}.items():
            weights[p + name_ + ".weight"], weights[p + name_ + ".bias"] = mat(o, n), vec(o)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            weights[p + norm + ".weight"], weights[p + norm + ".bias"] = 1 + vec(hidden), vec(hidden)
    save_weights(folder, weights, 1)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": max_position_embeddings}, indent=2))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules, indent=2))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens",
                                                                "mean_sqrt_len_tokens", "lasttoken")}
        modes["pooling_mode_cls_token"], modes["pooling_mode_mean_tokens"] = pooling == "cls", pooling == "mean"
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden} | modes))
        (folder / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_seq_length or max_position_embeddings, "do_lower_case": False}))
    return folder


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_ORDER[j] of its eight
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_rtn(w: np.ndarray, group: int, sym: bool, min_zero: int = 0, scale_dtype=np.float16, bits: int = 4
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An [in, out] float matrix rounded to `bits` bits per group of `group` inputs
    (round to nearest, GPTQ's and AWQ's grid without their calibration): values q and
    zero points in [0, 2^bits), scales of `scale_dtype`, w ~ scale * (q - zero).
    Symmetric: zero 2^(bits-1). `min_zero`: the smallest zero point (GPTQ's original
    format cannot store 0)."""
    k, n = w.shape
    levels = (1 << bits) - 1
    g = w.astype(np.float32).reshape(k // group, group, n)
    if sym:
        scale = 2 * np.abs(g).max(axis=1) / levels
        zero = np.full((k // group, n), 1 << (bits - 1), np.int32)
    else:
        lo, hi = np.minimum(g.min(axis=1), 0), np.maximum(g.max(axis=1), 0)
        scale = (hi - lo) / levels
    scale = np.where(scale > 0, scale, 1).astype(scale_dtype)
    s = scale.astype(np.float32)
    if not sym:
        zero = np.clip(np.round(-lo / s), min_zero, levels).astype(np.int32)
    q = np.clip(np.round(g / s[:, None]) + zero[:, None], 0, levels).astype(np.uint32).reshape(k, n)
    return q, zero, scale


def pack_words(values: np.ndarray, axis: int, order=tuple(range(8)), bits: int = 4) -> np.ndarray:
    """32 / `bits` values per int32 along `axis`: value order[j] of each in bits j * bits..
    (a last word padded with zeros, as compressed_tensors' pack_to_int32)."""
    per = 32 // bits
    order = order[:per] if bits == 4 else tuple(range(per))
    v = np.moveaxis(values.astype(np.uint32) & ((1 << bits) - 1), axis, -1)
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, -v.shape[-1] % per)])  # the last word padded with zeros
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    words = np.zeros(v.shape[:-1], np.uint32)
    for j, src in enumerate(order):
        words |= v[..., src] << np.uint32(bits * j)
    return np.moveaxis(words, -1, axis).view(np.int32)


def write_prequantized(hf_folder: Path, out: Path, method: str = "gptq", group: int = 128, sym: bool = False,
                       checkpoint_format: str = "gptq", lm_head: bool = False, act_order: bool = False,
                       bits: int = 4) -> tuple[Path, Path]:
    """`hf_folder`'s float model as a GPTQ, AWQ or compressed-tensors (pack-quantized,
    W4A16, bfloat16 scales) checkpoint (round to nearest, 4 bits, `group` inputs per
    scale: the tensors and quantization_config those tools write; GPTQ's "gptq"
    checkpoint_format stores each zero point less one), and beside it the float32
    checkpoint of exactly the weights it stands for, scale * (q - zero) (the oracle of a
    load that keeps the groups). `act_order` (GPTQ, compressed-tensors): the groups are
    formed in a random order of the inputs (one per input: q, k and v share theirs, as
    gate and up do), as GPTQ's desc_act forms them in the activations' order, and g_idx
    records each input's. `bits` 8: GPTQ's and compressed-tensors' 8-bit layouts (four
    values to a word). Returns (quantized folder, float folder)."""
    import zlib

    import ml_dtypes

    tensors = _hf_tensors(hf_folder)
    packed, exact = {}, {}
    for name, w in tensors.items():
        module = name[: -len(".weight")]
        if not (module.split(".")[-1] in PROJECTIONS or (lm_head and name == "lm_head.weight")):
            packed[name] = exact[name] = w
            continue
        k = w.shape[1]
        order = np.arange(k)
        if act_order:  # the same order for the projections of one input
            shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp"}
            key = module.rsplit(".", 2)[0] + shared.get(module.split(".")[-1], module.split(".")[-1])
            order = np.random.default_rng(zlib.crc32(key.encode())).permutation(k)
        q_sorted, zero, scale = quantize_rtn(
            w.T[order], group, sym, 1 if method == "gptq" and checkpoint_format == "gptq" else 0,
            ml_dtypes.bfloat16 if method == "compressed-tensors" else np.float16, bits)
        q, group_of = np.empty_like(q_sorted), np.empty(k, np.int64)
        q[order], group_of[order] = q_sorted, np.arange(k) // group
        exact[name] = np.ascontiguousarray((scale.astype(np.float32)[group_of]
                                            * (q.astype(np.float32) - zero[group_of].astype(np.float32))).T)
        if method == "gptq":
            stored_zero = zero - (1 if checkpoint_format == "gptq" else 0)
            packed |= {module + ".qweight": pack_words(q, 0, bits=bits),
                       module + ".qzeros": pack_words(stored_zero, 1, bits=bits),
                       module + ".scales": scale, module + ".g_idx": group_of.astype(np.int32)}
        elif method == "awq":
            packed |= {module + ".qweight": pack_words(q, 1, AWQ_ORDER),
                       module + ".qzeros": pack_words(zero, 1, AWQ_ORDER), module + ".scales": scale}
        else:  # [out, ...]; the values (and zero points) as signed ones plus 2^(bits-1): q and zero here
            packed |= {module + ".weight_packed": pack_words(q.T, 1, bits=bits), module + ".weight_scale": scale.T,
                       module + ".weight_shape": np.array(w.shape, np.int32)}
            if not sym:
                packed[module + ".weight_zero_point"] = pack_words(zero.T, 0, bits=bits)
            if act_order:
                packed[module + ".weight_g_idx"] = group_of.astype(np.int32)
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym,
              "checkpoint_format": checkpoint_format, "lm_head": lm_head}
    elif method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = _ct_config("pack-quantized", {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group",
                                           "group_size": group, "actorder": "group" if act_order else None}, None)
    return _write_pair(hf_folder, out / f"{hf_folder.name}-{method}{'-int8' if bits == 8 else ''}-g{group}",
                       packed, exact, qc)


def _write_pair(hf_folder: Path, folder: Path, stored: dict, exact: dict, qc: dict) -> tuple[Path, Path]:
    """`folder` (hf_folder's files, `stored` tensors, config.json with `qc`) and beside it
    `folder`-dequantized (the `exact` float32 tensors, no quantization_config)."""
    import shutil

    config = json.loads((hf_folder / "config.json").read_text())
    folders = (folder, folder.with_name(f"{folder.name}-dequantized"))
    for path, weights, extra in zip(folders, (stored, exact), ({"quantization_config": qc}, {})):
        shutil.copytree(hf_folder, path, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        (path / "config.json").write_text(json.dumps(config | extra, indent=2))
        # safetensors writes the buffer as laid out: contiguous copies
        save_weights(path, {n: np.ascontiguousarray(a) for n, a in weights.items()}, 1)
    return folders


# the 8-bit schemes write_scaled writes
SCALED_SCHEMES = ("w8a16", "w8a8", "w8a16-asym", "fp8-channel", "fp8-block")


def _ct_config(fmt: str, weights: dict, activations: dict | None) -> dict:
    """A compressed-tensors quantization_config of one scheme (`weights` over 8-bit
    symmetric static defaults), lm_head left unquantized."""
    scheme = {"targets": ["Linear"], "input_activations": activations, "output_activations": None,
              "weights": {"num_bits": 8, "symmetric": True, "dynamic": False, "group_size": None} | weights}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}


def _scaled_8bit(w: np.ndarray, scheme: str, block: tuple[int, int]) -> tuple[dict, np.ndarray]:
    """One [out, in] projection in `scheme`: its stored tensors (suffixes) and the float32
    matrix they stand for. int8: symmetric, scale amax / 127 in bfloat16 per block of
    `block` (rows, inputs; 0 all), or asymmetric ("-asym": (max - min) / 255 and a zero
    point); FP8: e4m3 values, float32 scales amax / 448."""
    import ml_dtypes

    out, k = w.shape
    rows, cols = (b or n for b, n in zip(block, (out, k)))
    grid = w.astype(np.float32).reshape(-(-out // rows), rows, k // cols, cols)
    amax, lo, hi = np.abs(grid).max(axis=(1, 3)), grid.min(axis=(1, 3)), grid.max(axis=(1, 3))
    fp8, asym = scheme.startswith("fp8"), scheme.endswith("-asym")
    step = (hi - lo) / 255 if asym else amax / (448 if fp8 else 127)
    scale = np.where(step > 0, step, 1).astype(np.float32 if fp8 else ml_dtypes.bfloat16)
    spread = lambda a: np.repeat(np.repeat(a, rows, 0), cols, 1)
    s = spread(scale.astype(np.float32))
    zero = np.clip(np.round(-lo / scale.astype(np.float32)) - 128, -128, 127).astype(np.int32) if asym else None
    z = 0 if zero is None else spread(zero)
    if fp8:
        values = (w / s).astype(ml_dtypes.float8_e4m3fn)
    else:
        values = np.clip(np.round(w / s) + z, -128, 127).astype(np.int8)
    exact = (values.astype(np.float32) - z) * s
    scale_name = "weight_scale_inv" if scheme == "fp8-block" else "weight_scale"
    if scheme.startswith("w8a16"):  # pack-quantized: four values plus 128 to an int32 along the inputs
        parts = {"weight_packed": _pack_bytes(values, 1), scale_name: scale,
                 "weight_shape": np.array(w.shape, np.int32)}
        return parts | ({} if zero is None else {"weight_zero_point": _pack_bytes(zero, 0)}), exact
    return {"weight": values, scale_name: scale}, exact


def _pack_bytes(values: np.ndarray, axis: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32 of int8 values: plus 128, four to a word along `axis`."""
    return pack_words(values.astype(np.int16) + 128, axis, bits=8)


def write_scaled(hf_folder: Path, out: Path, scheme: str = "w8a16", block: int = 32) -> tuple[Path, Path]:
    """`hf_folder`'s float model with its layers' projections in an 8-bit scheme (round
    to nearest): compressed-tensors "w8a16" (pack-quantized, int8 per channel), "w8a8"
    (int-quantized, per channel, activations quantized dynamically per token),
    "w8a16-asym" (pack-quantized per channel with zero points), "fp8-channel" (float-quantized,
    e4m3 per channel), or HF's fine-grained "fp8-block" (e4m3, a scale per `block` x
    `block`); beside it the float32 checkpoint of exactly the weights it stands for.
    Returns (quantized folder, float folder)."""
    blocks = {"w8a16": (1, 0), "w8a8": (1, 0), "w8a16-asym": (1, 0), "fp8-channel": (1, 0),
              "fp8-block": (block, block)}
    tensors = _hf_tensors(hf_folder)
    stored, exact = {}, {}
    for name, w in tensors.items():
        module = name[: -len(".weight")]
        if module.split(".")[-1] not in PROJECTIONS:
            stored[name] = exact[name] = w
            continue
        parts, exact[name] = _scaled_8bit(w, scheme, blocks[scheme])
        stored |= {f"{module}.{suffix}": a for suffix, a in parts.items()}
    token = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    qc = {"w8a16": _ct_config("pack-quantized", {"type": "int", "strategy": "channel"}, None),
          "w8a8": _ct_config("int-quantized", {"type": "int", "strategy": "channel"}, token),
          "w8a16-asym": _ct_config("pack-quantized", {"type": "int", "strategy": "channel", "symmetric": False},
                                   None),
          "fp8-channel": _ct_config("float-quantized", {"type": "float", "strategy": "channel"},
                                    token | {"type": "float"}),
          "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                        "weight_block_size": [block, block], "modules_to_not_convert": ["lm_head"]}}[scheme]
    return _write_pair(hf_folder, out / f"{hf_folder.name}-{scheme}", stored, exact, qc)


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q/k projections."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def write_gguf(hf_folder: Path, out_path: Path, tensor_type: str = "F32", overrides: dict[str, str] | None = None
               ) -> Path:
    """Convert one of the test HF folders to GGUF the way llama.cpp's converter does:
    llama.cpp names, q/k rows permuted for llama, Llama-3 scaling as `rope_freqs`,
    the tokenizer and chat template as metadata. 2-D weights are stored as
    `tensor_type` (any type gguf.quants can quantize), or as `overrides` names the
    type for tensors whose GGUF name ends so (e.g. {"attn_v.weight": "Q8_0"}: mixed
    types, as llama.cpp's Q4_K_M files have them); norms and biases stay F32."""
    import gguf

    from jaxllm.loaders.gguf_loader import gguf_tensor_name

    cfg = json.loads((hf_folder / "config.json").read_text())
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[
        cfg["model_type"]]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 1e4))
    if arch.startswith("gemma"):
        rope = _add_gemma_metadata(w, cfg, rope)
    w.add_rope_freq_base(rope["rope_theta"])
    _add_moe_metadata(w, cfg)

    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    template_file = hf_folder / "chat_template.jinja"
    tok_config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template", CHAT_TEMPLATE)
    w.add_chat_template(template)

    tensors = _stacked_experts(_hf_tensors(hf_folder))
    if rope.get("rope_type") == "llama3":
        from jaxllm.config import ModelConfig
        from jaxllm.models.rope import inverse_frequencies

        mc = ModelConfig.from_hf_config(cfg)
        base = inverse_frequencies(dataclasses.replace(mc.rope, type="default"), mc.head_dim)
        w.add_tensor("rope_freqs.weight", (base / inverse_frequencies(mc.rope, mc.head_dim)).astype(np.float32))
    for name, array in tensors.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp's converter: Gemma's norms stored as 1 + w
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, cfg["num_key_value_heads"])
        gguf_name = gguf_tensor_name(name, cfg["model_type"])
        kind = next((gguf.GGMLQuantizationType[t] for end, t in (overrides or {}).items() if gguf_name.endswith(end)),
                    qtype)
        if array.ndim in (2, 3) and kind != gguf.GGMLQuantizationType.F32 and "ffn_gate_inp" not in gguf_name:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _add_moe_metadata(w, cfg: dict) -> None:
    """A mixture of experts' GGUF keys, as llama.cpp's converter writes them."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _stacked_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert HF tensors as llama.cpp stacks them ([E, out, in], under
    expert 0's name, which gguf_tensor_name maps to the stacked tensor)."""
    import re

    out, stacks = {}, {}
    for name, array in tensors.items():
        m = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", name)
        if m is None:
            out[name] = array
        else:
            stacks.setdefault(m.group(1) + "0" + m.group(3), {})[int(m.group(2))] = array
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def _add_gemma_metadata(w, cfg: dict, rope: dict) -> dict:
    """Gemma's GGUF keys (the window, its layer pattern, the local RoPE base, the
    soft-caps); returns the full layers' RoPE parameters."""
    import gguf

    w.add_sliding_window(cfg["sliding_window"])
    if cfg["query_pre_attn_scalar"] != cfg["head_dim"]:  # llama.cpp assumes head_dim; jaxllm reads this key
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)):
        if cfg.get(key) is not None:
            add(cfg[key])
    if "full_attention" not in rope:
        return rope
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    full = rope["full_attention"]
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    return full


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(base: Path | dict, out: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                       targets: tuple[str, ...] = LORA_MODULES, use_rslora: bool = False, scale: float = 0.05,
                       layers: list[int] | None = None, extra_config: dict | None = None) -> Path:
    """A random LoRA adapter for the HF folder `base` (or a model of the HF config
    dict `base`), in PEFT's format (adapter_config.json, adapter_model.safetensors
    with PEFT's tensor names), both A and B random (a fresh PEFT adapter's B is zeros:
    it would change nothing)."""
    cfg = base if isinstance(base, dict) else json.loads((base / "config.json").read_text())
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or d // heads
    kv = cfg.get("num_key_value_heads", heads) * hd
    f = cfg["intermediate_size"]
    shapes = {"q_proj": (d, heads * hd), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (heads * hd, d),
              "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in layers if layers is not None else range(cfg["num_hidden_layers"]):
        for module in targets:
            n_in, n_out = shapes[module]
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{i}.{kind}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * scale).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * scale).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM",
                  base_model_name_or_path=None if isinstance(base, dict) else str(base), r=rank,
                  lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none",
                  use_rslora=use_rslora, use_dora=False, fan_in_fan_out=False, inference_mode=True,
                  layers_to_transform=layers, init_lora_weights=True, modules_to_save=None) | (extra_config or {})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


# Vision-language models (issue 65): made with HF transformers (and torch), so that
# their configs, tensor names and processors are the library's own. Tiny: 32x32 images.
VISION_LANGUAGE = ("llava", "gemma3_vlm")
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def write_vision_language_model(out: Path, name: str, seed: int = 0) -> Path:
    """A random-weight `LlavaForConditionalGeneration` (CLIP, 3 layers of which the
    feature layer is the second; 16 image tokens; Llama) or `Gemma3ForConditionalGeneration`
    (SigLIP, 8x8 patches pooled to 16 tokens; Gemma 3) with its HF processor and this
    module's tokenizer, in out/name."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    extra = ("<image>",) if name == "llava" else GEMMA3_IMAGE_TOKENS
    tok = train_tokenizer(extra_tokens=extra)
    named = dict(extra_special_tokens=dict(zip(("boi_token", "eoi_token", "image_token"), extra))) \
        if name == "gemma3_vlm" else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", **named)
    ids = [tok.token_to_id(t) for t in extra]
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                rms_norm_eps=1e-6, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, image_size=32)
    torch.manual_seed(seed)
    if name == "llava":
        config = LlavaConfig(
            text_config=LlamaConfig(**text, tie_word_embeddings=False),
            vision_config=CLIPVisionConfig(**vision, num_hidden_layers=3, patch_size=8, projection_dim=64),
            image_token_id=ids[0], projector_hidden_act="gelu", vision_feature_layer=-2,
            vision_feature_select_strategy="default")
        model = LlavaForConditionalGeneration(config)
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
            tokenizer=fast, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=CHAT_TEMPLATE)
    else:
        config = Gemma3Config(
            text_config=Gemma3TextConfig(**text, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                                         query_pre_attn_scalar=32, pad_token_id=fast.pad_token_id),
            vision_config=SiglipVisionConfig(**vision, num_hidden_layers=2, patch_size=4, vision_use_head=False),
            mm_tokens_per_image=16, boi_token_index=ids[0], eoi_token_index=ids[1], image_token_index=ids[2])
        model = Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # HF initializes these to zeros (1 + weight: ones): random, so the tests see them
            for param_name, param in model.named_parameters():
                if "norm" in param_name or "mm_input" in param_name:
                    param.normal_(0, 0.2)
        processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                    tokenizer=fast, image_seq_length=16, chat_template=CHAT_TEMPLATE)
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", default=",".join(ARCHITECTURES),
                        help=f"comma-separated, of {', '.join([*ARCHITECTURES, *REAL_SHAPES, *VISION_LANGUAGE])}, bert")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="default: 2, or the real shape's")
    parser.add_argument("--quantize", choices=("gptq", "awq", "compressed-tensors", *SCALED_SCHEMES), default=None,
                        help="also write each model as a 4-bit GPTQ / AWQ / compressed-tensors checkpoint or an 8-bit "
                             "one (compressed-tensors W8A16 / W8A8 / FP8, HF's block FP8; round to nearest), and the "
                             "float32 checkpoint of the weights it stands for")
    parser.add_argument("--group", type=int, default=128, help="--quantize: inputs per scale")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="--quantize gptq|compressed-tensors: "
                                                                           "bits per weight")
    args = parser.parse_args()
    for name in args.arch.split(","):
        if name == "bert":
            print(write_bert(args.out, seed=args.seed, layers=args.layers or 2, pooling="mean"))
            continue
        if name in VISION_LANGUAGE:
            print(write_vision_language_model(args.out, name, seed=args.seed))
            continue
        folder = write_model(args.out, name, seed=args.seed, layers=args.layers)
        print(folder)
        if args.quantize in SCALED_SCHEMES:
            print(*write_scaled(folder, args.out, args.quantize), sep="\n")
        elif args.quantize:
            print(*write_prequantized(folder, args.out, args.quantize, args.group, bits=args.bits), sep="\n")


if __name__ == "__main__":
    main()
