"""BERT encoders (HF `BertModel`: all-MiniLM-L6-v2 and the sentence-transformers models
built on it): the parameter declaration and the forward over a flat ragged batch.

An encoder attends bidirectionally inside each sequence and keeps no KV cache: a step
holds whole sequences, packed one after the other as the engine's steps are (no
padding between them), and each token sees the tokens of its own sequence only: on a
CPU through the C++ paged-attention kernel run bidirectionally over a cache the step
writes and drops (the `cpu` attention backend), elsewhere through `segment_attention`
(XLA). The parameters are declared in jaxllm.models.bert_params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.attention.cpu import ragged_paged_attention_cpu
from jaxllm.attention.kv_cache import KVCache, write_kv_cache
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.models.bert_params import BertLayerParams, BertParams
from jaxllm.models.linear import linear

QUERY_TILE = 64  # queries per tile of segment_attention (a divisor of every token bucket from 64 up)
# The key windows a tile may attend over, below the largest it may need: each tile takes the
# smallest holding its sequences (what it saves: docs/benchmarks.md, "Embeddings")
KEY_WINDOWS = (128, 192, 256, 320)


def layer_norm(x: Float[Array, "*B D"], weight: Float[Array, " D"], bias: Float[Array, " D"], eps: float
               ) -> Float[Array, "*B D"]:
    """LayerNorm in float32 (torch's: the biased variance)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centered = xf - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    out = centered * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return out.astype(x.dtype)


def gelu(x: Float[Array, "*B F"], kind: str) -> Float[Array, "*B F"]:
    """BERT's GELU: exact, as torch computes it (x / 2 * (1 + erf(x / sqrt 2)); jax's
    exact form goes through erfc, ~2x the time on XLA:CPU), or tanh's approximation."""
    if kind != "gelu":
        return jax.nn.gelu(x, approximate=True)
    return x * 0.5 * (1.0 + jax.lax.erf(x * np.float32(0.7071067811865476)))


def key_window(num_tokens: int, max_len: int) -> int:
    """The most keys a tile of QUERY_TILE queries may need: its queries' sequences reach
    at most max_len - 1 tokens before its first and after its last query (rounded up to
    8; the whole step when that is smaller)."""
    window = QUERY_TILE + 2 * (max_len - 1)
    return min(num_tokens, -(-window // 8) * 8)


def key_windows(num_tokens: int, max_len: int) -> tuple[int, ...]:
    """The key windows a tile may take, smallest first: KEY_WINDOWS below the largest it
    may need (`key_window`), and that one."""
    largest = key_window(num_tokens, max_len)
    return tuple(sorted({w for w in KEY_WINDOWS if w < largest} | {largest}))


def segment_attention(q: Float[Array, "T H hd"], k: Float[Array, "T H hd"], v: Float[Array, "T H hd"],
                      seg: Int[Array, " T"], sm_scale: float, max_len: int, causal: bool = False
                      ) -> Float[Array, "T H hd"]:
    """Attention of each token to the tokens of its own sequence (`seg`: its sequence
    index, ascending through the step; padding tokens share one index of their own), all
    of them or (`causal`) those up to it. The queries go in tiles of QUERY_TILE, each
    against the smallest of `key_windows` that holds the keys of its sequences (from the
    first query's sequence's start to the last's end; a sequence is at most `max_len`
    tokens), so the cost follows the lengths, not the step's tokens squared: a step of
    texts of ~130 tokens attends over a few hundred keys a query, not all of them."""
    t = q.shape[0]
    tile = min(t, QUERY_TILE)
    windows = key_windows(t, max_len)
    idx = jnp.arange(t, dtype=jnp.int32)

    def attend(start, first, window: int):
        qs = jax.lax.dynamic_slice_in_dim(q, start, tile)
        ks = jnp.clip(first, 0, t - window)  # kept inside the step
        kt, vt = (jax.lax.dynamic_slice_in_dim(a, ks, window) for a in (k, v))
        q_seg, k_seg = jax.lax.dynamic_slice_in_dim(seg, start, tile), jax.lax.dynamic_slice_in_dim(seg, ks, window)
        mask = q_seg[:, None] == k_seg[None, :]
        if causal:
            mask &= jax.lax.dynamic_slice_in_dim(idx, ks, window)[None, :] <= (start + jnp.arange(tile))[:, None]
        scores = jnp.einsum("qhd,khd->hqk", qs.astype(jnp.float32), kt.astype(jnp.float32)) * sm_scale
        probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("hqk,khd->qhd", probs, vt.astype(jnp.float32)).astype(q.dtype)

    def one_tile(start):
        q_seg = jax.lax.dynamic_slice_in_dim(seg, start, tile)
        first = jnp.searchsorted(seg, q_seg[0], side="left").astype(jnp.int32)
        end = jnp.searchsorted(seg, q_seg[-1], side="right").astype(jnp.int32)
        which = jnp.searchsorted(jnp.asarray(windows, jnp.int32), end - first, side="left")
        branches = [lambda start, first, w=w: attend(start, first, w) for w in windows]
        return jax.lax.switch(which, branches, start, first)

    starts = jnp.arange(0, t, tile, dtype=jnp.int32)
    return jax.lax.map(one_tile, starts).reshape(q.shape)


def attention(q: Float[Array, "T H hd"], k: Float[Array, "T H hd"], v: Float[Array, "T H hd"], seg: Int[Array, " T"],
              cfg: ModelConfig, max_len: int, cache: KVCache | None, md: AttentionMetadata | None
              ) -> tuple[Float[Array, "T H hd"], KVCache | None]:
    """Each token's attention over its own sequence: `segment_attention` (XLA), or with
    a step cache (the `cpu` backend) the C++ kernel, bidirectional, reading the K/V
    written into the step's blocks (`md`)."""
    if cache is None:
        return segment_attention(q, k, v, seg, cfg.sm_scale, max_len), None
    cache = write_kv_cache(cache, k, v, md.slot_mapping)
    out = ragged_paged_attention_cpu(q, cache.k, cache.v, md.seq_lens, md.block_tables, md.query_start_loc,
                                     md.num_seqs, sm_scale=cfg.sm_scale, cache_dtype=cache.dtype, causal=False)
    return out.astype(q.dtype), cache


def encoder_layer(lp: BertLayerParams, x: Float[Array, "T D"], seg: Int[Array, " T"], num_tokens: Int[Array, ""],
                  cfg: ModelConfig, max_len: int, cache: KVCache | None = None, md: AttentionMetadata | None = None
                  ) -> tuple[Float[Array, "T D"], KVCache | None]:
    """One post-norm BERT layer: self-attention, add, LayerNorm; GELU MLP, add, LayerNorm."""
    t, h, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    qkv = linear(x, lp.wqkv, rows=num_tokens) + lp.bqkv
    q, k, v = (a.reshape(t, h, hd) for a in jnp.split(qkv, 3, axis=-1))
    attn, cache = attention(q, k, v, seg, cfg, max_len, cache, md)
    attn = attn.reshape(t, h * hd)
    x = layer_norm(x + linear(attn, lp.wo, rows=num_tokens) + lp.bo, lp.attn_norm, lp.attn_norm_bias, cfg.rms_norm_eps)
    inner = gelu(linear(x, lp.w_in, rows=num_tokens) + lp.b_in, cfg.hidden_act)
    out = linear(inner, lp.w_out, rows=num_tokens) + lp.b_out
    return layer_norm(x + out, lp.mlp_norm, lp.mlp_norm_bias, cfg.rms_norm_eps), cache


def forward(params: BertParams, cfg: ModelConfig, token_ids: Int[Array, " T"], positions: Int[Array, " T"],
            token_types: Int[Array, " T"], seg: Int[Array, " T"], num_tokens: Int[Array, ""], max_len: int,
            caches: tuple[KVCache, ...] | None = None, md: AttentionMetadata | None = None
            ) -> tuple[Float[Array, "T D"], tuple[KVCache, ...] | None]:
    """The last layer's hidden states of every token of a flat batch of whole sequences
    (`seg`: each token's sequence; positions from 0 in each; the first `num_tokens`
    tokens real, the rest padding in a sequence index of its own), and the step caches
    (`caches`, one per layer, with `md` where each sequence's blocks are: the `cpu`
    attention kernel's; None: XLA's segment_attention)."""
    x = params.embed[token_ids] + params.positions[positions] + params.token_types[token_types]
    x = layer_norm(x, params.embed_norm, params.embed_norm_bias, cfg.rms_norm_eps)
    new_caches = []
    for i, lp in enumerate(params.layers):
        x, cache = encoder_layer(lp, x, seg, num_tokens, cfg, max_len, None if caches is None else caches[i], md)
        new_caches.append(cache)
    return x, None if caches is None else tuple(new_caches)
