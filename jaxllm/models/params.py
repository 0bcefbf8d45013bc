"""Parameter pytrees of a Llama-family model.

Weights are stored per layer (a tuple of LayerParams, not one stacked array): indexing
stacked weights inside jit, or scanning over layers, measured 4x slower at batch 1 on
XLA:CPU. Matmul weights are laid out [in, out] so a projection is `x @ w`, and the
projections that read the same input are fused: q/k/v into `wqkv`, gate/up into
`w_gate_up`. For the `cpu` linear backend the model runner packs them into panels
(PackedWeight; jaxllm.models.linear).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import struct
from jaxtyping import Array, Float

if TYPE_CHECKING:
    from jaxllm.config import ModelConfig


PANEL = 32  # columns per panel of a PackedWeight: kPanel in jaxllm/cpu_kernels/dense.cc


@struct.dataclass
class PackedWeight:
    """An [in, out] weight as panels of PANEL columns, [out/PANEL, in, PANEL], the last
    panel zero-padded: the layout the `cpu` linear backend multiplies."""

    panels: Float[Array, "P K 32"]
    out_features: int = struct.field(pytree_node=False)

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]


Weight = Float[Array, "K N"] | PackedWeight


@struct.dataclass
class LayerParams:
    attn_norm: Float[Array, "D"]
    wqkv: Weight  # [D, QKV] columns: q (H*hd) | k (Hkv*hd) | v (Hkv*hd)
    bqkv: Float[Array, "QKV"] | None  # Qwen2 / attention_bias
    q_norm: Float[Array, "hd"] | None  # Qwen3
    k_norm: Float[Array, "hd"] | None  # Qwen3
    wo: Weight  # [H*hd, D]
    mlp_norm: Float[Array, "D"]
    w_gate_up: Weight  # [D, 2F] columns: gate (F) | up (F)
    w_down: Weight  # [F, D]


@struct.dataclass
class ModelParams:
    embed: Float[Array, "V D"]
    layers: tuple[LayerParams, ...]
    final_norm: Float[Array, "D"]
    lm_head: Weight | None  # [D, V]; None when tied to `embed` (packed unless left to XLA's dot)


def abstract_params(cfg: ModelConfig, dtype) -> ModelParams:
    """ModelParams of jax.ShapeDtypeStruct leaves: the shapes `cfg` implies."""
    def spec(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = cfg.q_size + 2 * cfg.kv_size
    layer = LayerParams(
        attn_norm=spec(d),
        wqkv=spec(d, qkv),
        bqkv=spec(qkv) if cfg.qkv_bias else None,
        q_norm=spec(hd) if cfg.qk_norm else None,
        k_norm=spec(hd) if cfg.qk_norm else None,
        wo=spec(cfg.q_size, d),
        mlp_norm=spec(d),
        w_gate_up=spec(d, 2 * f),
        w_down=spec(f, d),
    )
    return ModelParams(
        embed=spec(cfg.vocab_size, d),
        layers=(layer,) * cfg.num_layers,
        final_norm=spec(d),
        lm_head=None if cfg.tie_word_embeddings else spec(d, cfg.vocab_size),
    )
