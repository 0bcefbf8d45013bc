"""The model as a plain function of token sequences: no paged KV cache, no engine.

What a trainer differentiates (`jax.grad` through `sequence_logprobs`) and the oracle of
the engine's logprobs: the decoder's own functions (jaxllm.models.llama's projections,
norms, RoPE, MLP and logits; every family the engine serves but the encoders), with the
attention computed densely over each sequence (causal, the layer's sliding window,
Gemma 2's soft cap, grouped KV heads). A batch is padded on the right; positions past a
sequence's length give values that are never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm.attention.cpu import ragged_paged_attention_cpu
from jaxllm.attention.kv_cache import KVCache
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.attention.xla import apply_soft_cap
from jaxllm.config import ModelConfig
from jaxllm.models.linear import is_packed, pack_params, unpack_params
from jaxllm.models.llama import compute_logits, embed_input, finish_layer, forward_hidden, qkv_heads, rope_rows
from jaxllm.models.params import ModelParams
from jaxllm.models.rope import RopeTable, model_rope_table
from jaxllm.models.vision import merge_image_embeddings
from jaxllm.sample.sampler import token_scores_cpu

INVARIANT_BLOCK = 16  # the block size of invariant_logprobs' cache (any gives the same sums)


def dense_attention(q: Float[Array, "T H hd"], k: Float[Array, "T Hkv hd"], v: Float[Array, "T Hkv hd"],
                    cfg: ModelConfig, window: int | None, blocks: Int[Array, " T"] | None = None) -> Float[Array, "T Q"]:
    """Causal softmax attention of one sequence (to the last `window` keys where the
    layer slides), in float32: [T, q_size]. `blocks`: tokens of the same block (>= 0)
    also see each other both ways (Gemma 3's images: `image_blocks`)."""
    t, h, hd = q.shape
    group = h // k.shape[1]
    qg = q.astype(jnp.float32).reshape(t, k.shape[1], group, hd)
    scores = jnp.einsum("qkgd,ckd->kgqc", qg, k.astype(jnp.float32)) * cfg.sm_scale
    scores = apply_soft_cap(scores, cfg.attn_logit_softcap)
    pos = jnp.arange(t)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    if blocks is not None:
        visible |= (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    o = jnp.einsum("kgqc,ckd->qkgd", p, v.astype(jnp.float32))
    return o.reshape(t, cfg.q_size)


def image_blocks(token_ids: Int[Array, " T"], image_token_id: int) -> Int[Array, " T"]:
    """Each token's image block: runs of image tokens numbered 0, 1, ... in order; -1
    for text."""
    is_image = token_ids == image_token_id
    starts = is_image & ~jnp.pad(is_image, (1, 0))[:-1]
    return jnp.where(is_image, jnp.cumsum(starts) - 1, -1)


def sequence_hidden(params: ModelParams, cfg: ModelConfig, rope: RopeTable, token_ids: Int[Array, " T"],
                    image_embeds: Float[Array, "M D"] | None = None) -> Float[Array, "T D"]:
    """One sequence's last hidden states (before the final norm); `image_embeds` (a
    vision-language model's: jaxllm.models.vision.encode_images, its images' rows in
    order) in place of its image tokens."""
    if cfg.is_encoder:
        raise ValueError(f"{cfg.model_type}: an encoder; the dense forward is the decoders'")
    positions = jnp.arange(token_ids.shape[0])
    rows = jnp.asarray(token_ids.shape[0], jnp.int32)  # every row is a token (no bucket padding)
    x = embed_input(params, token_ids, cfg, None)
    blocks = None
    if image_embeds is not None:
        x = merge_image_embeddings(x, token_ids, cfg.vision.image_token_id, image_embeds)
        blocks = image_blocks(token_ids, cfg.vision.image_token_id) if cfg.vision.bidirectional_images else None
    ropes = rope_rows(rope, positions)
    for i, lp in enumerate(params.layers):
        q, k, v = qkv_heads(lp, x, *ropes[cfg.is_sliding(i)], cfg)
        o = dense_attention(q, k, v, cfg, cfg.layer_window(i), blocks).astype(x.dtype)
        x = finish_layer(lp, x, o, rows, None, cfg=cfg, axis=None, moe=cfg.is_moe(i))
    return x


def sequence_logprobs(params: ModelParams, cfg: ModelConfig, token_ids: Int[Array, "B T"],
                      rope: RopeTable | None = None, image_embeds: Float[Array, "B M D"] | None = None,
                      batch_invariant: bool = False) -> Float[Array, "B T"]:
    """log p(token t | tokens before it) for t >= 1 of each row of `token_ids` (column 0,
    which nothing predicts, is 0): the logprobs the engine reports for prompt tokens and
    sampled ones, from the raw logits. Differentiable in `params`: load_model's, or the
    cpu backend's layout of them (jaxllm.models.linear.pack_params: what an engine
    with that backend takes as it is, no copy). `rope`: the RoPE
    table (default: made for T positions). `image_embeds`: each row's image embeddings
    (sequence_hidden's). `batch_invariant`: the values of an engine started with
    batch_invariant=True bit for bit (`invariant_logprobs`; float32 weights, a float32 KV
    cache), the gradient this function's own."""
    if batch_invariant:
        if image_embeds is not None:
            raise ValueError("batch_invariant: not for images (the engine refuses it for vision-language models)")
        return invariant_logprobs(params, cfg, token_ids, model_rope_table(cfg, token_ids.shape[1])
                                  if rope is None else rope)
    logits = sequence_logits(params, cfg, token_ids, rope, image_embeds)
    logprobs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logprobs, token_ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def sequence_logits(params: ModelParams, cfg: ModelConfig, token_ids: Int[Array, "B T"],
                    rope: RopeTable | None = None, image_embeds: Float[Array, "B M D"] | None = None
                    ) -> Float[Array, "B T V"]:
    """Every position's logits over the vocabulary (sequence_logprobs' arguments)."""
    rope = model_rope_table(cfg, token_ids.shape[1]) if rope is None else rope
    params = unpack_params(params) if is_packed(params) else params
    hidden = functools.partial(sequence_hidden, params, cfg, rope)
    states = jax.vmap(hidden)(token_ids) if image_embeds is None else jax.vmap(hidden)(token_ids, image_embeds)
    return jax.vmap(lambda x: compute_logits(params, x, cfg))(states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def invariant_logprobs(params: ModelParams, cfg: ModelConfig, token_ids: Int[Array, "B T"], rope: RopeTable
                       ) -> Float[Array, "B T"]:
    """sequence_logprobs as an engine with batch_invariant=True computes them: its own
    step code (jaxllm.models.llama.forward_hidden over a cache holding just these rows,
    each a sequence prefilled whole), the cpu kernels in their batch-invariant mode (the
    projections' per-row sums, the attention's decode path for every row) and its
    logprob kernel. A row's sums never depend on the rows beside it, so these are the
    engine's values for the same tokens, however it batched them. Its gradient is the
    dense forward's (the same function, summed in another order)."""
    return _kernel_logprobs(params, cfg, token_ids, rope)


def _kernel_logprobs(params: ModelParams, cfg: ModelConfig, token_ids: Int[Array, "B T"], rope: RopeTable
                     ) -> Float[Array, "B T"]:
    b, t = token_ids.shape
    if any(cfg.is_moe(i) for i in range(cfg.num_layers)):
        raise ValueError("batch_invariant: not yet for mixture-of-experts models")
    blocks = -(-t // INVARIANT_BLOCK)  # per sequence; block 0 is the null block
    tables = 1 + jnp.arange(b * blocks, dtype=jnp.int32).reshape(b, blocks)
    pos = jnp.arange(t, dtype=jnp.int32)
    md = AttentionMetadata(
        slot_mapping=(tables[:, pos // INVARIANT_BLOCK] * INVARIANT_BLOCK + pos % INVARIANT_BLOCK).reshape(-1),
        block_tables=tables, seq_lens=jnp.full((b,), t, jnp.int32),
        query_start_loc=jnp.arange(b + 1, dtype=jnp.int32) * t, num_seqs=jnp.asarray(b, jnp.int32),
        common_prefix_blocks=jnp.asarray(0, jnp.int32))
    shape = (1 + b * blocks, INVARIANT_BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = tuple(KVCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
                   for _ in range(cfg.kv_cache_groups(hybrid=False).group_size))
    packed = params if is_packed(params) else pack_params(params)
    attention = functools.partial(ragged_paged_attention_cpu, batch_invariant=True)
    hidden, _ = forward_hidden(packed, rope, caches, token_ids.reshape(-1), jnp.tile(pos, b), md, cfg=cfg,
                               attention_fn=attention)
    logits = compute_logits(packed, hidden, cfg, rows=jnp.asarray(b * t, jnp.int32))
    targets = jnp.pad(token_ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1).reshape(-1)
    scored = token_scores_cpu(logits, targets)[0].reshape(b, t)
    return jnp.pad(scored[:, :-1], ((0, 0), (1, 0)))


def _invariant_fwd(params, cfg, token_ids, rope):
    return _kernel_logprobs(params, cfg, token_ids, rope), (params, token_ids, rope)


def _invariant_bwd(cfg, residuals, g):
    params, token_ids, rope = residuals
    _, vjp = jax.vjp(lambda p, r: sequence_logprobs(p, cfg, token_ids, r), params, rope)
    grad_params, grad_rope = vjp(g)
    return grad_params, None, grad_rope


invariant_logprobs.defvjp(_invariant_fwd, _invariant_bwd)
