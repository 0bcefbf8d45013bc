"""A BERT encoder's parameters (HF `BertModel`), declared once like the decoder
families' (jaxllm.models.params): the HF tensors each is read from, its logical axes,
[in, out] projections with q | k | v fused; loading, abstract shapes and packing for the
`cpu` linear backend derive from it. The forward is jaxllm.models.bert."""

from __future__ import annotations

from flax import struct
from jaxtyping import Array, Float

from jaxllm.config import ModelConfig
from jaxllm.models.params import ParamDecl, Weight


@struct.dataclass
class BertLayerParams:
    wqkv: Weight  # [D, 3D] columns: q | k | v
    bqkv: Float[Array, " QKV"]
    wo: Weight  # [D, D]: the attention's output projection
    bo: Float[Array, " D"]
    attn_norm: Float[Array, " D"]  # the LayerNorm after the attention's residual add
    attn_norm_bias: Float[Array, " D"]
    w_in: Weight  # [D, F]: the MLP's "intermediate" projection
    b_in: Float[Array, " F"]
    w_out: Weight  # [F, D]
    b_out: Float[Array, " D"]
    mlp_norm: Float[Array, " D"]  # the LayerNorm after the MLP's residual add
    mlp_norm_bias: Float[Array, " D"]


@struct.dataclass
class BertParams:
    embed: Float[Array, "V D"]
    positions: Float[Array, "P D"]
    token_types: Float[Array, "Y D"]
    embed_norm: Float[Array, " D"]
    embed_norm_bias: Float[Array, " D"]
    layers: tuple[BertLayerParams, ...]


def declare(cfg: ModelConfig) -> BertParams:
    """Every parameter of a BERT encoder of `cfg` (HF `BertModel`'s names; a checkpoint
    saved from a task model prefixes them with "bert.", which the HF loader takes off)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    vec = lambda name, n=d, axis="embed": ParamDecl((n,), (axis,), ((name, n),))

    def layer(i: int) -> BertLayerParams:
        p = f"encoder.layer.{i}."
        qkv = tuple((p + f"attention.self.{part}.{{}}", d) for part in ("query", "key", "value"))
        named = lambda what: tuple((name.format(what), n) for name, n in qkv)
        return BertLayerParams(
            wqkv=ParamDecl((d, 3 * d), ("embed", "qkv"), named("weight"), transposed=True),
            bqkv=ParamDecl((3 * d,), ("qkv",), named("bias")),
            wo=ParamDecl((d, d), ("heads", "embed"), ((p + "attention.output.dense.weight", d),), transposed=True),
            bo=vec(p + "attention.output.dense.bias"),
            attn_norm=vec(p + "attention.output.LayerNorm.weight"),
            attn_norm_bias=vec(p + "attention.output.LayerNorm.bias"),
            w_in=ParamDecl((d, f), ("embed", "mlp"), ((p + "intermediate.dense.weight", f),), transposed=True),
            b_in=vec(p + "intermediate.dense.bias", f, "mlp"),
            w_out=ParamDecl((f, d), ("mlp", "embed"), ((p + "output.dense.weight", d),), transposed=True),
            b_out=vec(p + "output.dense.bias"),
            mlp_norm=vec(p + "output.LayerNorm.weight"),
            mlp_norm_bias=vec(p + "output.LayerNorm.bias"),
        )

    table = lambda name, rows, axis: ParamDecl((rows, d), (axis, "embed"), ((name, d),))
    return BertParams(
        embed=table("embeddings.word_embeddings.weight", cfg.vocab_size, "vocab"),
        positions=table("embeddings.position_embeddings.weight", cfg.max_position_embeddings, None),
        token_types=table("embeddings.token_type_embeddings.weight", cfg.type_vocab_size, None),
        embed_norm=vec("embeddings.LayerNorm.weight"),
        embed_norm_bias=vec("embeddings.LayerNorm.bias"),
        layers=tuple(layer(i) for i in range(cfg.num_layers)),
    )
