"""ModelConfig: the architecture hyper-parameters of a Llama-family model or a BERT
encoder.

Read from an HF ``config.json`` (transformers 4 form: ``rope_theta``, ``rope_scaling``,
``torch_dtype``; transformers 5 form: ``rope_parameters``, ``dtype``) or from GGUF
metadata. The config is a frozen dataclass so it can be a static argument of jitted
functions. Also the names of the engine's choices (dtype, attention and linear
backends), here at the bottom so that the engine's config and the resolvers share them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxllm.kv_cache_groups import KVCacheGroups, kv_cache_groups
from jaxllm.vision_config import VISION_LANGUAGE_ARCHITECTURES, VisionConfig

# The names of the engine's choices (EngineConfig validates them, the CLI offers them,
# the resolvers in jaxllm.platform, jaxllm.attention and jaxllm.models map them).
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas", "mosaic")
LINEAR_BACKENDS = ("auto", "xla", "cpu", "pallas")
# Weight quantization (jaxllm.models.quant): None keeps a checkpoint as stored (a GGUF
# whose projections are all Q8_0, all Q4_0 or all Q4_1 keeps those blocks; other GGUF
# types are dequantized), "none" dequantizes everything to the dtype, "int8" is
# weight-only int8 with a scale per output channel, "q8_0" / "q4_0" / "q4_1" GGUF's block
# formats (a scale, for Q4_1 also a min, per 32 inputs); a float checkpoint is
# quantized at load. A GPTQ / AWQ / compressed-tensors W4A16 checkpoint keeps its 4-bit groups as int4 (128),
# int4_g64 or int4_g32, an 8-bit GPTQ / W8A16 one by groups as int8_g128 / int8_g64 / int8_g32, a
# compressed-tensors W8A16 / W8A8 one its int8 per channel as int8; FP8 and other 8-bit schemes load with
# "none" only (jaxllm.loaders.prequantized).
# vLLM's names for the methods a checkpoint is stored in: asking one keeps the
# checkpoint as stored, after checking it is stored so.
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "gguf")
QUANTIZATIONS = (None, "none", "int8", "int4", "int4_g32", "int4_g64", "int8_g128", "int8_g64", "int8_g32", "q8_0",
                 "q4_0", "q4_1", "gguf_int8",
                 *CHECKPOINT_METHODS)
# The KV cache's element type (jaxllm.attention.kv_cache.KV_CACHE_FORMATS): "auto" is the
# model's dtype, or bfloat16 where activations are quantized (choose_kv_cache_format); "int8" keeps a float32 scale per token and KV head; "fp8" is
# "fp8_e4m3" (vLLM's names), saturated at +-448, no scale.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")
# The inputs of projections kept in blocks (jaxllm.models.quant): "none" (EngineConfig
# takes None for it too) multiplies them in float; "int8" quantizes them per 32 inputs
# and multiplies in integers, as llama.cpp does; "int16" the same with int16 values (steps 258 times finer,
# half int8's integer rate); "bfloat16" rounds them and each dequantized weight to bfloat16 (float32 sums:
# what a bfloat16 model's kept blocks multiply; on AMX's tiles where the CPU has them); "auto" is
# bfloat16 where the CPU kernel has AMX, int16 where it has integer dot products, else none
# (jaxllm.models.linear.auto_activation_quantization).
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8", "int16", "bfloat16")
# What the engine serves (vLLM's --runner): generated tokens, or pooled hidden states
# (embeddings); auto is pooling for an encoder, generate otherwise. --convert (vLLM's):
# how a generative checkpoint is served by the pooling runner (embed: its last hidden
# states pooled; auto: embed where the runner is pooling; none: refused there).
RUNNER_TYPES = ("auto", "generate", "pooling")
CONVERT_TYPES = ("auto", "none", "embed")

# HF architecture name -> model_type. One forward (jaxllm/models/llama.py) serves all of
# them; the differences are flags on ModelConfig (qkv bias, q/k norm, sliding windows,
# Gemma's norms, activation, scales and soft-caps).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "BertModel": "bert",
}
# Encoders (bidirectional attention, no KV cache, served for pooling only: jaxllm/models/bert.py).
ENCODER_TYPES = ("bert",)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Mixture of Experts: the MLP of (some) layers is a router over experts (models/moe.py).
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The MLP's activation: SwiGLU (silu) or GeGLU with the tanh approximation (Gemma); BERT's
# plain MLP the exact (erf) GELU.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# Per-layer attention kinds (HF's `layer_types`).
LAYER_TYPES = ("full_attention", "sliding_attention")

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model jaxllm cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency and optional frequency scaling."""

    theta: float = 10000.0
    type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only
    # GGUF `rope_freqs.weight`: per-frequency divisors llama.cpp stores instead of the
    # llama3 parameters; applied on top of `type`.
    freq_factors: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only transformer of the Llama family, or of a
    BERT encoder (`is_encoder`: LayerNorms with `rms_norm_eps` as their epsilon,
    learned absolute positions, `type_vocab_size` token types)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6  # the norms' epsilon (BERT's layer_norm_eps)
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's `attention_bias`
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # attend to the last `sliding_window` keys (every layer, or `layer_types`' sliding ones)
    layer_types: tuple[str, ...] = ()  # per layer, a LAYER_TYPES name (Gemma); (): every layer as `sliding_window` says
    rope_local: RopeConfig | None = None  # Gemma 3: the sliding layers' RoPE (None: `rope` for every layer)
    hidden_act: str = "silu"  # the gated MLP's activation, of SUPPORTED_ACTIVATIONS
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + weight)
    sandwich_norms: bool = False  # Gemma 2/3: each sublayer's output normed too, before the residual add
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size) (rounded to the embedding's dtype, as HF)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5 (None: head_dim ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(score / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    num_experts: int = 0  # MoE: experts per MoE layer (0: a dense MLP everywhere)
    num_experts_per_tok: int = 0  # MoE: experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0  # MoE: each expert's MLP width
    norm_topk_prob: bool = False  # MoE: the top-k probabilities renormalized to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert's width (0: none), sigmoid-gated
    dense_layers: tuple[int, ...] = ()  # MoE: layers whose MLP is dense (Qwen's mlp_only_layers, sparse step)
    type_vocab_size: int = 0  # BERT: token type (segment) embeddings
    checkpoint_dtype: str = "float32"
    quantization: str | None = None  # the projections as the engine holds them: None (as loaded), or a QUANTIZATIONS name
    embed_quantization: str | None = None  # the embedding (and a tied output projection): a GGUF's kept blocks, or None
    # A GGUF of mixed block types ("gguf_int8"): the projections whose blocks a tighter
    # container holds exactly, each with its QUANT_FORMATS name, keyed by its first HF
    # tensor's name (jaxllm.models.quant.mixed_gguf_format); the rest are gguf_int8
    tensor_quantization: tuple[tuple[str, str], ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # a vision-language model's image side (this config is its language model's)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden activation {self.hidden_act!r} is not supported; "
                                        f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                        f"{self.num_layers}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                                        f"{self.num_experts}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"layer type(s) {', '.join(unknown)} not supported; supported: "
                                        f"{', '.join(LAYER_TYPES)}")

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window `layer` attends through (None: every earlier key)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def kv_cache_groups(self, hybrid: bool = True) -> KVCacheGroups:
        """The layers' KV cache groups (jaxllm.kv_cache_groups): one group per attention
        type when `hybrid` and the layers mix them, else one of all layers."""
        return kv_cache_groups([self.layer_window(i) for i in range(self.num_layers)], hybrid)

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT): every token attends to its whole sequence,
        nothing is generated, no KV cache is kept (served for pooling only)."""
        return self.model_type in ENCODER_TYPES

    @property
    def sm_scale(self) -> float:
        """The attention scores' scale."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the lm_head included)."""
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
        )
        return self.num_layers * per_layer + self.hidden_size * self.vocab_size

    # ----------------------------------------------------------------- readers

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from the dict of an HF config.json (transformers 4 or 5 form)."""
        vision_language = next((a for a in hf.get("architectures") or [] if a in VISION_LANGUAGE_ARCHITECTURES), None)
        if vision_language is not None:
            return cls._from_vision_language(hf, vision_language, source)
        architecture = _hf_architecture(hf, source)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            head_dim = hf.get("head_dim") or hidden_size // num_heads
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            fields = dict(
                architecture=architecture,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in GEMMA_TYPES)),
                checkpoint_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
                quantization=hf.get("jaxllm_quantization"),
                embed_quantization=hf.get("jaxllm_embed_quantization"),
                tensor_quantization=tuple((str(k), str(v))
                                          for k, v in hf.get("jaxllm_tensor_quantization", {}).items()),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            return cls(**fields | _hf_family_fields(hf, model_type, source))  # the family's own fields win
        except KeyError as e:
            raise UnsupportedModelError(f"{source}: missing required field {e.args[0]!r}") from None

    @classmethod
    def _from_vision_language(cls, hf: Mapping[str, Any], architecture: str, source: str) -> ModelConfig:
        """A vision-language model: its language model's config (`text_config`, read as
        that family's), with the image side as `vision`."""
        text = dict(hf.get("text_config") or {})
        model_type = text.get("model_type") or VISION_LANGUAGE_ARCHITECTURES[architecture]
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        if model_type not in by_type:
            raise UnsupportedModelError(f"{source}: language model {model_type!r} of {architecture} is not supported")
        text.setdefault("architectures", [by_type[model_type]])
        text.setdefault("dtype", hf.get("dtype") or hf.get("torch_dtype"))
        if "tie_word_embeddings" in hf:
            text.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
        cfg = cls.from_hf_config(text, f"{source} (text_config)")
        return dataclasses.replace(cfg, vision=VisionConfig.from_hf_config(hf, architecture, cfg.hidden_size, source))

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model folder")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_config(hf, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "GGUF") -> ModelConfig:
        """Build from GGUF key/value metadata (already decoded to Python values)."""
        arch = meta.get("general.architecture")
        gguf_archs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
        if arch not in gguf_archs:
            raise UnsupportedModelError(
                f"{source}: unsupported GGUF architecture {arch!r}; supported: {sorted(gguf_archs)}"
            )

        def get(key: str, default: Any = ...) -> Any:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is ...:
                raise UnsupportedModelError(f"{source}: missing GGUF metadata {full!r}")
            return default

        num_heads = int(get("attention.head_count"))
        hidden_size = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden_size // num_heads))
        scaling_type = get("rope.scaling.type", "none")
        rope = RopeConfig(theta=float(get("rope.freq_base", 10000.0)))
        if scaling_type == "linear":
            rope = dataclasses.replace(rope, type="linear", factor=float(get("rope.scaling.factor")))
        elif scaling_type not in ("none", None):
            raise UnsupportedModelError(f"{source}: unsupported rope scaling {scaling_type!r}")
        vocab = meta.get("tokenizer.ggml.tokens")
        vocab_size = int(get("vocab_size", len(vocab) if vocab is not None else 0))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        moe = _gguf_moe_fields(arch, get)
        return cls(
            architecture="MixtralForCausalLM" if arch == "llama" and moe else gguf_archs[arch],
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length", 2048)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope=rope,
            tie_word_embeddings=False,  # set by the loader from whether output.weight exists
            qkv_bias=arch in ("qwen2", "qwen2moe"),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
            checkpoint_dtype="float32",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **(_gguf_gemma_fields(arch, get, num_heads, hidden_size, head_dim) if arch.startswith("gemma") else {}),
            **moe,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers-5 form config.json of this model (converted checkpoints, and
        exporting a GGUF to an HF folder). GGUF `rope_freqs` factors are kept under the
        non-HF key `rope_freq_factors`."""
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": _rope_parameters(self.rope),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "dtype": self.checkpoint_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope.freq_factors is not None:  # not an HF field: jaxllm reads it back
            out["rope_freq_factors"] = list(self.rope.freq_factors)
        if self.quantization is not None:  # a converted checkpoint holding quantized projections
            out["jaxllm_quantization"] = self.quantization
        if self.embed_quantization is not None:  # ... or a quantized embedding
            out["jaxllm_embed_quantization"] = self.embed_quantization
        if self.tensor_quantization:  # ... or projections of several formats
            out["jaxllm_tensor_quantization"] = dict(self.tensor_quantization)
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
        if self.model_type in ("mistral", "mixtral"):
            out["sliding_window"] = self.sliding_window
        if self.model_type in MOE_TYPES:
            out.update(self._moe_hf_fields())
        if self.model_type in ("qwen2", "qwen3") and self.sliding_window is not None:
            out.update(use_sliding_window=True, sliding_window=self.sliding_window, layer_types=list(self.layer_types),
                       max_window_layers=self.layer_types.index("sliding_attention"))
        if self.model_type in GEMMA_TYPES:
            out.update(self._gemma_hf_fields())
        if self.is_encoder:
            out.update(layer_norm_eps=self.rms_norm_eps, type_vocab_size=self.type_vocab_size,
                       position_embedding_type="absolute")
            for key in ("num_key_value_heads", "head_dim", "rope_parameters", "rms_norm_eps", "tie_word_embeddings"):
                del out[key]
        return out

    def _moe_hf_fields(self) -> dict[str, Any]:
        if self.model_type == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "intermediate_size": self.moe_intermediate_size}
        out: dict[str, Any] = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                               "moe_intermediate_size": self.moe_intermediate_size,
                               "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": 1,
                               "mlp_only_layers": list(self.dense_layers)}
        if self.model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return out

    def _gemma_hf_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hidden_activation": self.hidden_act,
            "query_pre_attn_scalar": int(qpas) if (qpas := self.query_pre_attn_scalar).is_integer() else qpas,
            "sliding_window": self.sliding_window, "layer_types": list(self.layer_types),
            "attn_logit_softcapping": self.attn_logit_softcap, "final_logit_softcapping": self.final_logit_softcap,
        }
        if self.rope_local is not None:  # Gemma 3: a RoPE per layer type
            out["rope_parameters"] = {"full_attention": _rope_parameters(self.rope),
                                      "sliding_attention": _rope_parameters(self.rope_local)}
        return out


def _rope_parameters(rope: RopeConfig) -> dict[str, Any]:
    """`rope` in transformers 5's `rope_parameters` form."""
    out: dict[str, Any] = {"rope_type": rope.type, "rope_theta": rope.theta}
    if rope.type != "default":
        out["factor"] = rope.factor
    if rope.type == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    return out


def _gguf_gemma_fields(arch: str, get, num_heads: int, hidden_size: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2 / 3 fields from GGUF metadata, with what llama.cpp hard-codes rather than
    stores: the layer pattern (Gemma 2: every other layer sliding; Gemma 3: five of
    six), Gemma 3's local RoPE base (10,000), and the query scale (1 / sqrt(hidden /
    heads) for the 27B models, 1 / sqrt(head_dim) otherwise). The norms' (1 + w) is in
    the file's weights (llama.cpp's converter adds the 1; the loader takes it off)."""
    layers = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern", 6 if arch == "gemma3" else 2)  # a period, or per layer
    sliding = list(pattern) if isinstance(pattern, (list, tuple)) else [(i + 1) % int(pattern) != 0
                                                                        for i in range(layers)]
    big = layers == (62 if arch == "gemma3" else 46)  # the 27B models
    cap = lambda key: _optional_float(get(key, None))
    return dict(
        sliding_window=int(get("attention.sliding_window")),
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
        rope_local=RopeConfig(theta=float(get("rope.freq_base_swa", 10000.0))) if arch == "gemma3" else None,
        hidden_act="gelu_pytorch_tanh", norm_offset=1.0, sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(get("attention.scale", 0.0) ** -2 if get("attention.scale", None)
                                    else hidden_size // num_heads if big else head_dim),
        attn_logit_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"),
    )


def _hf_architecture(hf: Mapping[str, Any], source: str) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if not archs and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    named = archs or [hf.get("model_type")]
    raise UnsupportedModelError(
        f"{source}: unsupported architecture {', '.join(map(str, named))}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _hf_family_fields(hf: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The ModelConfig fields in which the families differ, from an HF config."""
    if model_type in ENCODER_TYPES:
        return _hf_bert_fields(hf, source)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    bias = model_type in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = dict(hidden_act=act, qkv_bias=bias,
                                  qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"))
    # Gemma 3 has a RoPE per layer type (_gemma3_ropes); the others one
    fields.update(_gemma3_ropes(hf, source) if model_type == "gemma3_text" else dict(rope=_hf_rope(hf, source)))
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window") and hf.get("sliding_window"):
        # HF's rule: the layers from `max_window_layers` on slide, the ones below attend to all
        first = int(hf.get("max_window_layers", 28))
        layer_types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                                for i in range(int(hf["num_hidden_layers"]))]
        fields.update(sliding_window=int(hf["sliding_window"]), layer_types=tuple(layer_types))
    if model_type in ("mistral", "mixtral") and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
    if model_type in MOE_TYPES:
        fields.update(_hf_moe_fields(hf, model_type))
    if model_type not in GEMMA_TYPES:
        return fields
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention=true (an embedding model) is not supported")
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or _gemma_layer_types(hf, model_type, layers)
    fields.update(
        sliding_window=int(hf.get("sliding_window") or 4096), layer_types=tuple(layer_types),
        norm_offset=1.0, sandwich_norms=True, scale_embeddings=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
        attn_logit_softcap=_optional_float(hf.get("attn_logit_softcapping")),
        final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
    )
    return fields


def _hf_bert_fields(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A BERT encoder's fields: LayerNorm epsilon, token types, the GELU; refused where
    it is not the absolute-position BertModel jaxllm runs."""
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise UnsupportedModelError(f"{source}: position_embedding_type {kind!r} is not supported (absolute only)")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise UnsupportedModelError(f"{source}: a BERT decoder (is_decoder, add_cross_attention) is not supported")
    return dict(hidden_act=hf.get("hidden_act", "gelu"), rms_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                type_vocab_size=int(hf.get("type_vocab_size", 2)), tie_word_embeddings=False)


def _gguf_moe_fields(arch: str, get) -> dict[str, Any]:
    """A GGUF's experts as llama.cpp's converter records them: `expert_count`,
    `expert_used_count`, each expert's width (`expert_feed_forward_length`; Mixtral's,
    stored as arch llama, is `feed_forward_length`), Qwen2-MoE's shared expert; the
    top-k renormalized as llama.cpp computes each (`expert_weights_norm` where the file
    says: Mixtral and Qwen3-MoE yes, Qwen2-MoE no). Which layers are dense the tensors
    say (the loader). {} for a dense model."""
    experts = int(get("expert_count", 0))
    if not experts:
        return {}
    width = int(get("expert_feed_forward_length")) if arch != "llama" else int(get("feed_forward_length"))
    return dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")), moe_intermediate_size=width,
                norm_topk_prob=bool(get("expert_weights_norm", arch != "qwen2moe")),
                shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)))


def _hf_moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """Mixtral: every layer routes to top-k of `num_local_experts` experts of
    `intermediate_size`, the top-k renormalized; Qwen2/3-MoE: `num_experts` of
    `moe_intermediate_size`, renormalized where `norm_topk_prob`, dense layers where
    `mlp_only_layers` or `decoder_sparse_step` say, Qwen2-MoE with a shared expert."""
    layers = int(hf["num_hidden_layers"])
    if model_type == "mixtral":
        return dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    step, only = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or ())
    return dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe" else 0,
                dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _gemma_layer_types(hf: Mapping[str, Any], model_type: str, layers: int) -> list[str]:
    """Gemma's pattern where the config lists no `layer_types`: Gemma 2 alternates
    sliding and full layers; Gemma 3 has one full layer every `sliding_window_pattern`
    (6)."""
    pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern")
                                                   or hf.get("_sliding_window_pattern") or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _gemma3_ropes(hf: Mapping[str, Any], source: str) -> dict[str, RopeConfig]:
    """Gemma 3's two RoPEs: `rope` of the full layers, `rope_local` of the sliding ones
    (transformers 5: `rope_parameters` per layer type; 4: `rope_theta` and
    `rope_scaling` for the full layers, `rope_local_base_freq` for the sliding ones)."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        return dict(rope=_hf_rope({"rope_parameters": params["full_attention"]}, source),
                    rope_local=_hf_rope({"rope_parameters": params["sliding_attention"]}, source))
    return dict(rope=_hf_rope(hf, source),
                rope_local=RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0))))


def _hf_rope(hf: Mapping[str, Any], source: str) -> RopeConfig:
    """RoPE from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4)."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rope = RopeConfig(theta=float(params.get("rope_theta", 10000.0)), type=rope_type)
    if rope_type == "linear":
        rope = dataclasses.replace(rope, factor=float(params["factor"]))
    elif rope_type == "llama3":
        rope = dataclasses.replace(
            rope,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if hf.get("rope_freq_factors") is not None:
        rope = dataclasses.replace(rope, freq_factors=tuple(float(f) for f in hf["rope_freq_factors"]))
    return rope
