"""A vision-language model's image side (issue 65): images in, the language model's
input embeddings out, one row per image token.

The vision tower is a ViT (CLIP's or SigLIP's): the image cut into patches, each
projected (the patch convolution as a matrix product), learned positions added (after
CLIP's class token), then pre-norm encoder layers attending bidirectionally over the
image. The projector maps the chosen layer's output into the language model's
embedding space: LLaVA's two linears around a GELU, or Gemma 3's average pooling to
`tokens_per_image` tokens, RMSNorm and one linear. Parameters: jaxllm.models.vision_params.
Everything is computed in float32, as the tower's sums are short.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm.models.bert import gelu, layer_norm
from jaxllm.models.vision_params import VisionLayerParams, VisionParams
from jaxllm.vision_config import VisionConfig


def activation(x: Float[Array, "... F"], kind: str) -> Float[Array, "... F"]:
    """CLIP's quick GELU, the tanh approximation (SigLIP) or the exact GELU."""
    if kind == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    return gelu(x, "gelu" if kind == "gelu" else "gelu_pytorch_tanh")


def patch_embeddings(vp: VisionParams, cfg: VisionConfig, pixels: Float[Array, "N C H W"]) -> Float[Array, "N P D"]:
    """Each non-overlapping patch times the convolution's kernel, in row-major patch order."""
    n, c = pixels.shape[:2]
    p, g = cfg.patch_size, cfg.image_size // cfg.patch_size
    patches = pixels.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
    kernel = vp.patch_embed.reshape(cfg.hidden_size, c * p * p).astype(jnp.float32)
    x = jnp.einsum("npk,dk->npd", patches.astype(jnp.float32), kernel)
    return x if vp.patch_bias is None else x + vp.patch_bias.astype(jnp.float32)


def embeddings(vp: VisionParams, cfg: VisionConfig, pixels: Float[Array, "N C H W"]) -> Float[Array, "N S D"]:
    """The tower's input: patch embeddings (after CLIP's class token) plus positions, and
    CLIP's LayerNorm before the layers."""
    x = patch_embeddings(vp, cfg, pixels)
    if vp.class_embed is not None:
        cls = jnp.broadcast_to(vp.class_embed.astype(jnp.float32), (x.shape[0], 1, x.shape[2]))
        x = jnp.concatenate([cls, x], axis=1)
    x = x + vp.positions.astype(jnp.float32)
    if vp.pre_norm is not None:
        x = layer_norm(x, vp.pre_norm, vp.pre_norm_bias, cfg.layer_norm_eps)
    return x


def encoder_layer(lp: VisionLayerParams, x: Float[Array, "N S D"], cfg: VisionConfig) -> Float[Array, "N S D"]:
    """Pre-norm: attention over the whole image, then the MLP, each added to its input."""
    n, s, d = x.shape
    h = layer_norm(x, lp.norm1, lp.norm1_bias, cfg.layer_norm_eps)
    qkv = (h @ lp.wqkv.astype(jnp.float32) + lp.bqkv.astype(jnp.float32)).reshape(n, s, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k) * cfg.head_dim ** -0.5
    o = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(scores, axis=-1), v).reshape(n, s, d)
    x = x + o @ lp.wo.astype(jnp.float32) + lp.bo.astype(jnp.float32)
    h = layer_norm(x, lp.norm2, lp.norm2_bias, cfg.layer_norm_eps)
    h = activation(h @ lp.fc1.astype(jnp.float32) + lp.fc1_bias.astype(jnp.float32), cfg.hidden_act)
    return x + h @ lp.fc2.astype(jnp.float32) + lp.fc2_bias.astype(jnp.float32)


def image_features(vp: VisionParams, cfg: VisionConfig, pixels: Float[Array, "N C H W"]) -> Float[Array, "N S D"]:
    """The tower's output the projector reads: the feature layer's (SigLIP's through its
    post-norm), without CLIP's class token unless the model keeps it."""
    x = embeddings(vp, cfg, pixels)
    for lp in vp.layers:
        x = encoder_layer(lp, x, cfg)
    if vp.post_norm is not None:
        x = layer_norm(x, vp.post_norm, vp.post_norm_bias, cfg.layer_norm_eps)
    if cfg.tower == "clip" and not cfg.keep_class_token:
        x = x[:, 1:]
    return x


def project(vp: VisionParams, cfg: VisionConfig, x: Float[Array, "N S D"]) -> Float[Array, "N T Dt"]:
    """Into the language model's embedding space: LLaVA's MLP, or Gemma 3's pooling,
    norm and projection."""
    if cfg.projector == "mlp":
        h = x @ vp.proj1.astype(jnp.float32)
        h = h if vp.proj1_bias is None else h + vp.proj1_bias.astype(jnp.float32)
        h = activation(h, cfg.projector_act) @ vp.proj2.astype(jnp.float32)
        return h if vp.proj2_bias is None else h + vp.proj2_bias.astype(jnp.float32)
    n, _, d = x.shape
    g, t = cfg.image_size // cfg.patch_size, int(cfg.tokens_per_image ** 0.5)
    k = g // t
    pooled = x.reshape(n, t, k, t, k, d).mean(axis=(2, 4)).reshape(n, t * t, d)
    normed = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, axis=-1, keepdims=True) + cfg.layer_norm_eps)
    return (normed * (1.0 + vp.proj_norm.astype(jnp.float32))) @ vp.proj1.astype(jnp.float32)


def encode_images(vp: VisionParams, cfg: VisionConfig, pixels: Float[Array, "N C H W"]) -> Float[Array, "N T Dt"]:
    """Preprocessed images (jaxllm.multimodal.image_processor) -> each image's
    `tokens_per_image` embeddings for the language model, float32."""
    return project(vp, cfg, image_features(vp, cfg, pixels))


def merge_image_embeddings(x: Float[Array, "T D"], token_ids: Int[Array, " T"], image_token_id: int,
                           image_embeds: Float[Array, "M D"]) -> Float[Array, "T D"]:
    """The text embeddings `x` with the image tokens' rows replaced by `image_embeds`, in
    order (the i-th image token takes row i), in x's dtype."""
    is_image = token_ids == image_token_id
    row = jnp.clip(jnp.cumsum(is_image) - 1, 0, max(image_embeds.shape[0] - 1, 0))
    return jnp.where(is_image[:, None], image_embeds[row].astype(x.dtype), x)
