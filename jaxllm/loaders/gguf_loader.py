"""GGUF files (llama.cpp's format), read with the `gguf` library.

Quantized tensors are dequantized to the compute dtype, except the projections: a file
whose projections are all Q8_0, all Q4_0 or all Q4_1 keeps those blocks (their values,
scales and mins, jaxllm.models.quant); one whose projections mix the affine block
types (GGUF_INT8_TYPES: a Q4_K_M file's Q4_K, Q6_K, Q5_0, Q8_0...) keeps every weight
exactly in the `gguf_int8` container (int8 values, a scale and min per 16 inputs), or
where all of a projection's parts allow, in a tighter container that holds them as
exactly (`mixed_gguf_format`: Q4_K as int4_g32, Q5_0 and Q8_0 as q8_0...).
llama.cpp's interleaved row order of attn_q / attn_k (its converter permutes them for
its RoPE kernel) is undone so the standard rotate-half RoPE applies. The tokenizer (BPE vocab, merges, special tokens) and chat template come from
the file's metadata.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.config import GEMMA_TYPES, ModelConfig
from jaxllm.loaders.weights import CheckpointError, build_params
from jaxllm.models.params import QUANT_FORMATS, ModelParams, QuantizedWeight, declarations
from jaxllm.models.quant import GGUF_INT8_TYPES, block_parts, gguf_container_parts, mixed_gguf_format, quantized_config


def _dequantizable_types() -> tuple[str, ...]:
    """Every GGUF tensor type the installed gguf library dequantizes: F32, F16 and the
    types of its quantizer table, the one `gguf.quants.dequantize` dispatches on."""
    import gguf.quants

    return ("F32", "F16", *sorted(t.name for t in gguf.quants._type_traits))


SUPPORTED_TENSOR_TYPES = _dequantizable_types()
# GGUF types whose blocks jaxllm keeps as they are (the projections' quantization) when
# every projection of a file is of one of them; the other types are dequantized.
KEPT_TENSOR_TYPES = {name.upper(): name for name in ("q8_0", "q4_0", "q4_1")}

_LAYER_NAMES = {  # HF suffix -> GGUF suffix, inside "model.layers.N." / "blk.N."
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Mixture of experts: the router, Qwen2-MoE's shared expert and its gate
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# Each expert's HF tensor is one slice of llama.cpp's stacked [E, out, in] tensor.
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                 "down_proj": "ffn_down_exps.weight", "w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight",
                 "w2": "ffn_down_exps.weight"}
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# Gemma 2 / 3: a norm after each sublayer; the MLP's input norm is its own tensor.
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_expert_slice(hf_name: str) -> tuple[str, int] | None:
    """An expert's HF tensor as (llama.cpp's stacked tensor, the expert's index in it);
    None for any other tensor."""
    m = _EXPERT_RE.fullmatch(hf_name)
    if m is None or m.group(3) not in _EXPERT_NAMES:
        return None
    return f"blk.{m.group(1)}.{_EXPERT_NAMES[m.group(3)]}", int(m.group(2))


def gguf_tensor_name(hf_name: str, model_type: str = "llama") -> str:
    """llama.cpp's name of an HF tensor of a `model_type` model (an expert's: the
    stacked tensor it is a slice of, `gguf_expert_slice`)."""
    if (expert := gguf_expert_slice(hf_name)) is not None:
        return expert[0]
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    names = _GEMMA_LAYER_NAMES if model_type in GEMMA_TYPES else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(hf_name)
    if m is None or m.group(2) not in names:
        raise KeyError(hf_name)
    return f"blk.{m.group(1)}.{names[m.group(2)]}"


def gguf_norm_shift(model_type: str) -> float:
    """What llama.cpp's converter adds to a `model_type` model's RMSNorm weights: 1 for
    Gemma (its norms scale by 1 + w; the GGUF stores 1 + w), else 0."""
    return 1.0 if model_type in GEMMA_TYPES else 0.0


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of q/k projection rows."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An open GGUF file: decoded metadata and dequantizing tensor access."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: GGUF file not found")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # unknown tensor type ids and truncation surface here
            raise CheckpointError(f"{self.path}: cannot read GGUF file ({type(e).__name__}: {e})") from None
        self.metadata: dict[str, Any] = {k: f.contents() for k, f in self._reader.fields.items()}
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_tensor_types()

    def _check_tensor_types(self) -> None:
        for t in self._reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which jaxllm "
                    f"cannot dequantize; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str, expert: int | None = None) -> np.ndarray | None:
        """float32 array in PyTorch/HF orientation ([out, in] for matrices); of a
        stacked [E, out, in] tensor, expert `expert`'s slice alone."""
        import gguf

        t = self._tensors.get(name)
        if t is None:
            return None
        data = t.data if expert is None else t.data[expert]
        return gguf.quants.dequantize(data, t.tensor_type).astype(np.float32, copy=False)

    def tensor_type(self, name: str) -> str | None:
        t = self._tensors.get(name)
        return None if t is None else t.tensor_type.name

    def quantized_tensor(self, name: str, held: str | None = None, expert: int | None = None) -> QuantizedWeight:
        """A Q8_0 / Q4_0 / Q4_1 tensor's blocks as they are (`held` its own format), or
        any of GGUF_INT8_TYPES in the container `held` (gguf_int8, or the one
        `mixed_gguf_format` gives it), in HF orientation ([out, in]): values [out, in]
        and scales (and mins) [out, in / group]: float16 as the file's blocks have
        them, float32 where the container's are (QuantizedWeight's fields, not yet laid out)."""
        t = self._tensors[name]
        rows, cols = int(t.shape[1]), int(t.shape[0])  # ggml lists the fastest dimension first
        data = t.data if expert is None else t.data[expert]  # a stacked [E, out, in]: one expert's rows
        if KEPT_TENSOR_TYPES.get(t.tensor_type.name) == held:
            return block_parts(data, QUANT_FORMATS[held], rows, cols)
        return gguf_container_parts(data, t.tensor_type.name, rows, cols, held)

    def own_quantization(self, cfg: ModelConfig) -> str | None:
        """The format jaxllm keeps the projections of `cfg` in: when every one is stored
        in the same type of KEPT_TENSOR_TYPES, that ("q8_0", "q4_0", "q4_1"); when they
        are all of GGUF_INT8_TYPES, "gguf_int8"; else None (the file is dequantized)."""
        types = set().union(*self._projection_types(cfg).values())
        if len(types) == 1 and next(iter(types)) in KEPT_TENSOR_TYPES:
            return KEPT_TENSOR_TYPES[types.pop()]
        return "gguf_int8" if types <= set(GGUF_INT8_TYPES) else None

    def own_tensor_quantization(self, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        """Of a file of mixed block types (`own_quantization` "gguf_int8"): each projection
        whose parts a tighter container than gguf_int8 holds exactly, keyed by its
        declaration's first HF tensor name, with that container (`mixed_gguf_format`)."""
        formats = ((name, mixed_gguf_format(types)) for name, types in self._projection_types(cfg).items())
        return tuple((name, fmt) for name, fmt in formats if fmt != "gguf_int8")

    def _projection_types(self, cfg: ModelConfig) -> dict[str, set[str]]:
        """Each projection of `cfg` (by its first HF tensor's name): the GGUF types of its
        parts (a mixture's first expert's, where the experts are tensors of their own)."""
        return {decl.hf[0][0]: {self.tensor_type(gguf_tensor_name(name.format(e=0), cfg.model_type))
                                for name, _ in decl.hf}
                for decl in declarations(quantized_config(cfg, "q8_0")) if decl.quant}

    def own_embed_quantization(self) -> str | None:
        """The format jaxllm keeps the token embedding in (a tied output projection too)
        when the file stores it in one of KEPT_TENSOR_TYPES; else None."""
        return KEPT_TENSOR_TYPES.get(self.tensor_type("token_embd.weight"))

    def model_config(self) -> ModelConfig:
        cfg = ModelConfig.from_gguf_metadata(self.metadata, source=str(self.path))
        cfg = dataclasses.replace(cfg, tie_word_embeddings=not self.has_tensor("output.weight"))
        if cfg.num_experts:  # a layer without stacked experts has a dense MLP (Qwen2-MoE's mlp_only_layers)
            dense = tuple(i for i in range(cfg.num_layers) if not self.has_tensor(f"blk.{i}.ffn_gate_exps.weight"))
            cfg = dataclasses.replace(cfg, dense_layers=dense)
        rope_freqs = self.tensor("rope_freqs.weight")  # Llama 3.1+ frequency scaling
        if rope_freqs is not None:
            factors = tuple(float(f) for f in rope_freqs.reshape(-1))
            cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, freq_factors=factors))
        return cfg

    def tokenizer(self):
        """A transformers PreTrainedTokenizerFast built from the GGUF metadata."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        meta = self.metadata
        if "tokenizer.ggml.tokens" not in meta:
            raise CheckpointError(f"{self.path}: GGUF file holds no tokenizer")
        fields = {
            name: meta[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in meta
        }
        backend, _ = convert_gguf_tokenizer(meta["general.architecture"], fields)
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None else None

        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            unk_token=token("unknown_token_id"),
            pad_token=token("padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )


def load_gguf_params(gguf_file: GGUFFile, cfg: ModelConfig, dtype, on_host: bool = False) -> ModelParams:
    """The file's weights for `cfg`: with `cfg.quantization` the file's own
    (`own_quantization`) the projections' blocks as they are (QuantizedWeight),
    everything else dequantized to `dtype`."""
    permute_rope = cfg.model_type in ("llama", "mistral", "mixtral")  # llama.cpp's arch llama
    kept = {name: decl.quant for decl in declarations(cfg) if decl.quant  # HF name (each expert's) -> its format
            for one in decl.per_expert() for name, _ in one.hf}
    shift = gguf_norm_shift(cfg.model_type)

    def source(hf_name: str) -> np.ndarray | QuantizedWeight | None:
        name, expert = gguf_expert_slice(hf_name) or (gguf_tensor_name(hf_name, cfg.model_type), None)
        held = kept.get(hf_name)
        w = gguf_file.quantized_tensor(name, held, expert) if held else gguf_file.tensor(name, expert)
        if hf_name.endswith("shared_expert_gate.weight") and w is not None and w.ndim == 1:
            return w[None]  # llama.cpp stores Qwen2-MoE's [1, D] shared-expert gate as [D]
        if w is not None and shift and hf_name.endswith("norm.weight"):
            return w - np.float32(shift)
        if w is None or not permute_rope:
            return w
        if isinstance(w, QuantizedWeight):  # the RoPE row order is undone on values, scales and mins alike
            return w.map_arrays(lambda rows: _unpermuted(hf_name, rows, cfg))
        return _unpermuted(hf_name, w, cfg)

    return build_params(cfg, source, dtype, str(gguf_file.path), on_host=on_host)


def _unpermuted(hf_name: str, rows: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if hf_name.endswith("q_proj.weight"):
        return unpermute_rope_rows(rows, cfg.num_heads)
    if hf_name.endswith("k_proj.weight"):
        return unpermute_rope_rows(rows, cfg.num_kv_heads)
    return rows

