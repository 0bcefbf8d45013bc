"""A vision-language model's image side (issue 65), declared once like the language
models' parameters (jaxllm.models.params): the vision tower (CLIP's or SigLIP's ViT)
and the projector into the language model's embedding space, each parameter with the
HF tensors it is read from. Loading, abstract shapes and exporting derive from it; the
forward is jaxllm.models.vision.

The names are the hub checkpoints' (`vision_tower.vision_model.*`,
`multi_modal_projector.*`); the loader also finds them as transformers 5 saves them
(jaxllm.loaders.hf.vision_language_names). Only the layers up to the feature layer are
declared: LLaVA reads the second-to-last layer's output, so its tower's last layer is
never run nor loaded (as vLLM).
"""

from __future__ import annotations

from flax import struct
from jaxtyping import Array, Float

from jaxllm.models.params import ParamDecl, Weight
from jaxllm.vision_config import VisionConfig

TOWER = "vision_tower.vision_model."
PROJECTOR = "multi_modal_projector."


@struct.dataclass
class VisionLayerParams:
    norm1: Float[Array, " D"]  # LayerNorm before the attention
    norm1_bias: Float[Array, " D"]
    wqkv: Weight  # [D, 3D] columns: q | k | v
    bqkv: Float[Array, " QKV"]
    wo: Weight  # [D, D]
    bo: Float[Array, " D"]
    norm2: Float[Array, " D"]  # LayerNorm before the MLP
    norm2_bias: Float[Array, " D"]
    fc1: Weight  # [D, F]
    fc1_bias: Float[Array, " F"]
    fc2: Weight  # [F, D]
    fc2_bias: Float[Array, " D"]


@struct.dataclass
class VisionParams:
    patch_embed: Float[Array, "D C P P2"]  # the patch convolution's kernel, as stored
    patch_bias: Float[Array, " D"] | None  # SigLIP's
    class_embed: Float[Array, " D"] | None  # CLIP's class token
    positions: Float[Array, "N D"]  # learned, one per patch (and the class token)
    pre_norm: Float[Array, " D"] | None  # CLIP's LayerNorm before the layers ("pre_layrnorm")
    pre_norm_bias: Float[Array, " D"] | None
    layers: tuple[VisionLayerParams, ...]
    post_norm: Float[Array, " D"] | None  # SigLIP's, where the model reads the last layer through it
    post_norm_bias: Float[Array, " D"] | None
    # the projector: LLaVA's two linears with an activation between (proj2 None: Gemma 3's
    # one, after its RMSNorm `proj_norm`)
    proj1: Weight  # [Dv, Dt]
    proj1_bias: Float[Array, " Dt"] | None
    proj2: Weight | None  # [Dt, Dt]
    proj2_bias: Float[Array, " Dt"] | None
    proj_norm: Float[Array, " Dv"] | None  # Gemma 3's mm_soft_emb_norm (scaled by 1 + weight)


def declare_vision(cfg: VisionConfig) -> VisionParams:
    """Every parameter of `cfg`'s tower (its first `num_layers` layers) and projector."""
    d, f, c, p = cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size
    vec = lambda name, n=d: ParamDecl((n,), (None,), ((name, n),))
    linear = lambda name, n_in, n_out: ParamDecl((n_in, n_out), (None, None), ((name, n_out),), transposed=True)

    def layer(i: int) -> VisionLayerParams:
        pre = f"{TOWER}encoder.layers.{i}."
        qkv = tuple((f"{pre}self_attn.{part}_proj.{{}}", d) for part in "qkv")
        named = lambda what: tuple((name.format(what), n) for name, n in qkv)
        return VisionLayerParams(
            norm1=vec(pre + "layer_norm1.weight"), norm1_bias=vec(pre + "layer_norm1.bias"),
            wqkv=ParamDecl((d, 3 * d), (None, None), named("weight"), transposed=True),
            bqkv=ParamDecl((3 * d,), (None,), named("bias")),
            wo=linear(pre + "self_attn.out_proj.weight", d, d), bo=vec(pre + "self_attn.out_proj.bias"),
            norm2=vec(pre + "layer_norm2.weight"), norm2_bias=vec(pre + "layer_norm2.bias"),
            fc1=linear(pre + "mlp.fc1.weight", d, f), fc1_bias=vec(pre + "mlp.fc1.bias", f),
            fc2=linear(pre + "mlp.fc2.weight", f, d), fc2_bias=vec(pre + "mlp.fc2.bias"),
        )

    clip, emb = cfg.tower == "clip", TOWER + "embeddings."
    dt = cfg.text_hidden_size
    mlp = cfg.projector == "mlp"
    bias = lambda name, n: vec(PROJECTOR + name, n) if mlp and cfg.projector_bias else None
    return VisionParams(
        patch_embed=ParamDecl((d, c, p, p), (None,) * 4, ((emb + "patch_embedding.weight", p),)),
        patch_bias=None if clip else vec(emb + "patch_embedding.bias"),
        class_embed=vec(emb + "class_embedding") if clip else None,
        positions=ParamDecl((cfg.num_positions, d), (None, None), ((emb + "position_embedding.weight", d),)),
        pre_norm=vec(TOWER + "pre_layrnorm.weight") if clip else None,
        pre_norm_bias=vec(TOWER + "pre_layrnorm.bias") if clip else None,
        layers=tuple(layer(i) for i in range(cfg.num_layers)),
        post_norm=vec(TOWER + "post_layernorm.weight") if cfg.post_norm else None,
        post_norm_bias=vec(TOWER + "post_layernorm.bias") if cfg.post_norm else None,
        proj1=linear(PROJECTOR + "linear_1.weight", d, dt) if mlp else
        ParamDecl((d, dt), (None, None), ((PROJECTOR + "mm_input_projection_weight", dt),)),  # stored [in, out]
        proj1_bias=bias("linear_1.bias", dt),
        proj2=linear(PROJECTOR + "linear_2.weight", dt, dt) if mlp else None,
        proj2_bias=bias("linear_2.bias", dt),
        proj_norm=None if mlp else vec(PROJECTOR + "mm_soft_emb_norm.weight"),
    )
