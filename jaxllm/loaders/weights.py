"""Assemble ModelParams from named checkpoint tensors (HF names, [out, in] layout).

Every loader (HF safetensors, GGUF) reduces to a `TensorSource`: a function from an HF
tensor name to a numpy array (or None when absent). This module checks each shape
against the ModelConfig, transposes to [in, out], fuses q/k/v and gate/up, and moves
the result to the device in the compute dtype.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.models.params import LayerParams, ModelParams

TensorSource = Callable[[str], "np.ndarray | None"]


class CheckpointError(ValueError):
    """A checkpoint file is missing a tensor, has a wrong shape, or cannot be read."""


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name an HF checkpoint of this config must hold."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if cfg.qkv_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {}
    for name in hf_tensor_names(cfg):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (cfg.vocab_size, d)
        elif name.endswith(("layernorm.weight", "model.norm.weight")):
            shapes[name] = (d,)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[name] = (hd,)
        elif ".q_proj." in name:
            shapes[name] = (cfg.q_size, d) if name.endswith("weight") else (cfg.q_size,)
        elif ".k_proj." in name or ".v_proj." in name:
            shapes[name] = (cfg.kv_size, d) if name.endswith("weight") else (cfg.kv_size,)
        elif ".o_proj." in name:
            shapes[name] = (d, cfg.q_size)
        elif ".gate_proj." in name or ".up_proj." in name:
            shapes[name] = (f, d)
        elif ".down_proj." in name:
            shapes[name] = (d, f)
    return shapes


def build_params(cfg: ModelConfig, source: TensorSource, dtype, where: str) -> ModelParams:
    """Read every tensor through `source`, validate, fuse and place on device.

    `where` names the checkpoint in error messages.
    """
    shapes = hf_tensor_shapes(cfg)

    def get(name: str) -> np.ndarray:
        array = source(name)
        if array is None:
            raise CheckpointError(f"{where}: missing tensor {name!r}")
        if tuple(array.shape) != shapes[name]:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"but the model config implies {shapes[name]}"
            )
        return np.asarray(array, dtype=np.float32)

    def dev(array: np.ndarray):
        return jnp.asarray(array, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        wqkv = np.concatenate([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], axis=0).T
        bqkv = (
            dev(np.concatenate([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            if cfg.qkv_bias
            else None
        )
        gate_up = np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], axis=0).T
        layers.append(
            LayerParams(
                attn_norm=dev(get(p + "input_layernorm.weight")),
                wqkv=dev(wqkv),
                bqkv=bqkv,
                q_norm=dev(get(p + "self_attn.q_norm.weight")) if cfg.qk_norm else None,
                k_norm=dev(get(p + "self_attn.k_norm.weight")) if cfg.qk_norm else None,
                wo=dev(get(p + "self_attn.o_proj.weight").T),
                mlp_norm=dev(get(p + "post_attention_layernorm.weight")),
                w_gate_up=dev(gate_up),
                w_down=dev(get(p + "mlp.down_proj.weight").T),
            )
        )
    return ModelParams(
        embed=dev(get("model.embed_tokens.weight")),
        layers=tuple(layers),
        final_norm=dev(get("model.norm.weight")),
        lm_head=None if cfg.tie_word_embeddings else dev(get("lm_head.weight").T),
    )


def params_to_hf_tensors(cfg: ModelConfig, params: ModelParams) -> dict[str, np.ndarray]:
    """The inverse of build_params: HF-named float32 numpy tensors (for exporting)."""
    out = {
        "model.embed_tokens.weight": np.asarray(params.embed, np.float32),
        "model.norm.weight": np.asarray(params.final_norm, np.float32),
    }
    if params.lm_head is not None:
        out["lm_head.weight"] = np.asarray(params.lm_head, np.float32).T
    for i, lp in enumerate(params.layers):
        p = f"model.layers.{i}."
        q, k, v = np.split(np.asarray(lp.wqkv, np.float32).T, [cfg.q_size, cfg.q_size + cfg.kv_size])
        gate, up = np.split(np.asarray(lp.w_gate_up, np.float32).T, 2)
        out.update(
            {
                p + "input_layernorm.weight": np.asarray(lp.attn_norm, np.float32),
                p + "post_attention_layernorm.weight": np.asarray(lp.mlp_norm, np.float32),
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": np.asarray(lp.wo, np.float32).T,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": np.asarray(lp.w_down, np.float32).T,
            }
        )
        if lp.bqkv is not None:
            bq, bk, bv = np.split(np.asarray(lp.bqkv, np.float32), [cfg.q_size, cfg.q_size + cfg.kv_size])
            out.update({p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk, p + "self_attn.v_proj.bias": bv})
        if lp.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = np.asarray(lp.q_norm, np.float32)
            out[p + "self_attn.k_norm.weight"] = np.asarray(lp.k_norm, np.float32)
    return {name: np.ascontiguousarray(t) for name, t in out.items()}
