"""BERT encoders (HF `BertModel`: all-MiniLM-L6-v2 and the sentence-transformers models
built on it): the parameter declaration and the forward over a flat ragged batch.

An encoder attends bidirectionally inside each sequence and keeps no KV cache: a step
holds whole sequences, packed one after the other as the engine's steps are (no
padding between them), and `segment_attention` lets each token see the tokens of its
own sequence only. The parameters are declared in jaxllm.models.bert_params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm.config import ModelConfig
from jaxllm.models.bert_params import BertLayerParams, BertParams
from jaxllm.models.linear import linear

QUERY_TILE = 64  # queries per tile of segment_attention (a divisor of every token bucket from 64 up)


def layer_norm(x: Float[Array, "T D"], weight: Float[Array, " D"], bias: Float[Array, " D"], eps: float
               ) -> Float[Array, "T D"]:
    """LayerNorm in float32 (torch's: the biased variance)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centered = xf - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    out = centered * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return out.astype(x.dtype)


def key_window(num_tokens: int, max_len: int) -> int:
    """The keys a tile of QUERY_TILE queries may need: its queries' sequences reach
    at most max_len - 1 tokens before its first and after its last query (rounded up to
    8; the whole step when that is smaller)."""
    window = QUERY_TILE + 2 * (max_len - 1)
    return min(num_tokens, -(-window // 8) * 8)


def segment_attention(q: Float[Array, "T H hd"], k: Float[Array, "T H hd"], v: Float[Array, "T H hd"],
                      seg: Int[Array, " T"], sm_scale: float, max_len: int, causal: bool = False
                      ) -> Float[Array, "T H hd"]:
    """Attention of each token to the tokens of its own sequence (`seg`: its sequence
    index; padding tokens share one index of their own), all of them or (`causal`) those
    up to it. The step's queries go in tiles of QUERY_TILE, each against the window of
    `key_window` keys around it (a sequence is at most `max_len` tokens), so the cost
    follows the tokens times the window, not the step's tokens squared."""
    t = q.shape[0]
    tile = min(t, QUERY_TILE)
    window = key_window(t, max_len)
    idx = jnp.arange(t, dtype=jnp.int32)

    def one_tile(start):
        qs = jax.lax.dynamic_slice_in_dim(q, start, tile)
        # keys from where the tile's first sequence can start, kept inside the step
        ks = jnp.clip(start - (max_len - 1), 0, t - window)
        kt, vt = (jax.lax.dynamic_slice_in_dim(a, ks, window) for a in (k, v))
        q_seg, k_seg = jax.lax.dynamic_slice_in_dim(seg, start, tile), jax.lax.dynamic_slice_in_dim(seg, ks, window)
        mask = q_seg[:, None] == k_seg[None, :]
        if causal:
            mask &= jax.lax.dynamic_slice_in_dim(idx, ks, window)[None, :] <= (start + jnp.arange(tile))[:, None]
        scores = jnp.einsum("qhd,khd->hqk", qs.astype(jnp.float32), kt.astype(jnp.float32)) * sm_scale
        scores = jnp.where(mask[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("hqk,khd->qhd", probs, vt.astype(jnp.float32)).astype(q.dtype)

    starts = jnp.arange(0, t, tile, dtype=jnp.int32)
    return jax.lax.map(one_tile, starts).reshape(q.shape)


def encoder_layer(lp: BertLayerParams, x: Float[Array, "T D"], seg: Int[Array, " T"], num_tokens: Int[Array, ""],
                  cfg: ModelConfig, max_len: int) -> Float[Array, "T D"]:
    """One post-norm BERT layer: self-attention, add, LayerNorm; GELU MLP, add, LayerNorm."""
    t, h, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    qkv = linear(x, lp.wqkv, rows=num_tokens) + lp.bqkv
    q, k, v = (a.reshape(t, h, hd) for a in jnp.split(qkv, 3, axis=-1))
    attn = segment_attention(q, k, v, seg, cfg.sm_scale, max_len).reshape(t, h * hd)
    x = layer_norm(x + linear(attn, lp.wo, rows=num_tokens) + lp.bo, lp.attn_norm, lp.attn_norm_bias, cfg.rms_norm_eps)
    inner = jax.nn.gelu(linear(x, lp.w_in, rows=num_tokens) + lp.b_in, approximate=cfg.hidden_act != "gelu")
    out = linear(inner, lp.w_out, rows=num_tokens) + lp.b_out
    return layer_norm(x + out, lp.mlp_norm, lp.mlp_norm_bias, cfg.rms_norm_eps)


def forward(params: BertParams, cfg: ModelConfig, token_ids: Int[Array, " T"], positions: Int[Array, " T"],
            token_types: Int[Array, " T"], seg: Int[Array, " T"], num_tokens: Int[Array, ""], max_len: int
            ) -> Float[Array, "T D"]:
    """The last layer's hidden states of every token of a flat batch of whole sequences
    (`seg`: each token's sequence; positions from 0 in each; the first `num_tokens`
    tokens real, the rest padding in a sequence index of its own)."""
    x = params.embed[token_ids] + params.positions[positions] + params.token_types[token_types]
    x = layer_norm(x, params.embed_norm, params.embed_norm_bias, cfg.rms_norm_eps)
    for lp in params.layers:
        x = encoder_layer(lp, x, seg, num_tokens, cfg, max_len)
    return x
