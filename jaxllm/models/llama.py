"""The forward pass of the Llama family (Llama, Mistral, Qwen2, Qwen3) and of Gemma 2 and
3 over a paged KV cache: one function for any step, a flat ragged batch of prefill
chunks and decodes.

Pure functions over ModelParams; the differences between the architectures are flags
on ModelConfig (qkv bias, q/k RMSNorm, sliding windows per layer and a RoPE for the
sliding ones, Gemma's (1 + w) norms around each sublayer, GeGLU, scaled embeddings, query
scale and soft-caps, experts in place of the MLP: Mixtral, Qwen2/3-MoE), read at trace
time.

Under tensor parallelism (jaxllm.models.parallel) the same functions run on one shard
of the parameters inside `shard_map`, with `cfg` the shard's (its heads, its share of
the MLP and vocabulary) and `axis` the mesh axis to reduce over: the row-parallel
projections' partial sums are all-reduced, the vocabulary-parallel embedding is looked up
where a shard holds the token and all-reduced, and the logits are all-gathered.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxllm.attention.backends import AttentionFn
from jaxllm.attention.image_blocks import ImageBlocks
from jaxllm.attention.kv_cache import KVCache, fold_layer_scales, unfold_layer_scales, write_kv_cache
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.attention.xla import apply_soft_cap
from jaxllm.config import ModelConfig
from jaxllm.models.formats import Panels
from jaxllm.models.linear import MeshAxes, all_reduce, linear, packed_rows
from jaxllm.models.lora import LayerLoRA, LoRAInputs
from jaxllm.models.moe import gated, moe_mlp
from jaxllm.models.params import LayerParams, ModelParams, PackedWeight, QuantizedWeight
from jaxllm.models.quant import dequantize
from jaxllm.models.rope import RopeTable, apply_rope
from jaxllm.models.row_ops import NORM_DTYPES, add_rms_norm_cpu, gated_cpu, rms_norm_cpu
from jaxllm.platform import activation_dtype


def row_sums(x: Float[Array, "... D"], lanes: int = 16) -> Float[Array, "... 1"]:
    """The sums along the last axis, each in one fixed order whatever the leading shape:
    `lanes` running sums over the row's slices of `lanes` in turn, then halved. XLA's
    reduce picks its order by the row count (7 rows of 576 summed otherwise than 8), so a
    row's norm would hang on the batch it came in; elementwise adds are never reordered."""
    d = x.shape[-1]
    parts = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -d % lanes)]).reshape(*x.shape[:-1], -1, lanes)
    acc = parts[..., 0, :]
    for i in range(1, parts.shape[-2]):
        acc = acc + parts[..., i, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float, offset: float = 0.0
             ) -> Float[Array, "... D"]:
    """RMSNorm in float32, scaled by `offset + weight` (Gemma's offset is 1); each row's
    mean square in a fixed order (`row_sums`: a row normed alone or in any batch is the
    same bits)."""
    xf = x.astype(jnp.float32)
    # the squares apart from their sums: fused, the compiler may contract a square and
    # its add into one multiply-add (rounded once), and a row would hang on the fusion
    squares = jax.lax.optimization_barrier(xf * xf)
    normed = xf * jax.lax.rsqrt(row_sums(squares) / x.shape[-1] + eps)
    scale = weight.astype(jnp.float32) + offset if offset else weight.astype(jnp.float32)
    return (scale * normed).astype(x.dtype)


def norm_before(w, x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float, offset: float = 0.0
                ) -> Float[Array, "... D"]:
    """rms_norm of the rows `w` multiplies next: by the C++ kernel where `w` is packed
    for the `cpu` backend (jaxllm.models.row_ops; the library is loaded there), else jnp."""
    if isinstance(w, PackedWeight) and x.dtype in NORM_DTYPES:
        return rms_norm_cpu(x, weight, eps, offset)
    return rms_norm(x, weight, eps, offset)


def add_norm_before(w, x: Float[Array, "T D"], y: Float[Array, "T D"], weight: Float[Array, " D"], eps: float,
                    offset: float = 0.0) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """(x + y, rms_norm(x + y)) for the projection `w` that reads the norm: one pass of
    the C++ kernel where `w` is packed for the `cpu` backend, else jnp."""
    if isinstance(w, PackedWeight) and x.dtype in NORM_DTYPES and y.dtype == x.dtype and x.ndim == 2:
        return add_rms_norm_cpu(x, y, weight, eps, offset)
    s = x + y
    return s, rms_norm(s, weight, eps, offset)


def gated_before(w, x: Float[Array, "T F2"], act: str) -> Float[Array, "T F"]:
    """act(gate) * up of `x` for the projection `w` that reads it: by the C++ kernel where
    `w` is packed for the `cpu` backend and x float32, else jnp (moe.gated)."""
    if isinstance(w, PackedWeight) and x.dtype == jnp.float32 and x.ndim == 2:
        return gated_cpu(x, act)
    return gated(x, act)


def embed_tokens(embed: Float[Array, "V D"] | QuantizedWeight | PackedWeight, input_ids: Int[Array, " T"],
                 axis: MeshAxes) -> Float[Array, "T D"]:
    """Embedding rows of `input_ids` (a quantized embedding's rows dequantized: the
    values a dequantized table holds; a tied table packed as the output projection read
    from its panels); sharded by vocabulary over `axis`, each shard contributes the rows
    it holds (zeros elsewhere) and the shards' rows are summed."""
    def rows(ids):
        if isinstance(embed, PackedWeight):
            return packed_rows(embed, ids)
        return dequantize(embed.take_rows(ids)) if isinstance(embed, QuantizedWeight) else embed[ids]

    if axis is None:
        return rows(input_ids)
    v = embed.shape[0]
    local = input_ids - jax.lax.axis_index(axis) * v
    held = (local >= 0) & (local < v)
    return all_reduce(jnp.where(held[:, None], rows(jnp.clip(local, 0, v - 1)), 0), axis)


def self_attention(
    lp: LayerParams,
    x: Float[Array, "T D"],
    cos: Float[Array, "T half"],
    sin: Float[Array, "T half"],
    cache: KVCache,
    md: AttentionMetadata,
    cfg: ModelConfig,
    attention_fn: AttentionFn,
    window: int | None = None,
    lora: LayerLoRA | None = None,
    images: ImageRows | None = None,
) -> tuple[Float[Array, "T Q"], KVCache]:
    """The attention sublayer up to its output projection: writes this step's K/V into
    the cache, then attends through the block tables, to the last `window` keys where
    the layer slides. Returns the heads' outputs, [T, q_size]. `lora`: each token's
    adapter added to the projections (jaxllm.models.lora). `images`: Gemma 3's images
    attend both ways (`ImageRows.blocks`)."""
    q, k, v = qkv_heads(lp, x, cos, sin, cfg, lora, md.num_tokens)
    with jax.named_scope("kv_write"):
        cache = write_kv_cache(cache, k, v, md.slot_mapping)
    o = attend(q, cache, md, cfg, attention_fn, window)
    if images is not None and images.blocks is not None:
        o = images.blocks.attend(o, q, cache, md, tokens_per_image=cfg.vision.tokens_per_image, sm_scale=cfg.sm_scale,
                                 window=window, soft_cap=cfg.attn_logit_softcap)
    return o, cache


def qkv_heads(lp: LayerParams, x: Float[Array, "T D"], cos: Float[Array, "T half"], sin: Float[Array, "T half"],
              cfg: ModelConfig, lora: LayerLoRA | None = None, rows: Int[Array, ""] | None = None
              ) -> tuple[Float[Array, "T H hd"], Float[Array, "T Hkv hd"], Float[Array, "T Hkv hd"]]:
    """The attention's queries, keys and values by head: normed input, projection (and
    bias), Qwen3's q/k norms, RoPE. `rows`: the real tokens (the kernel skips the
    bucket's padding rows)."""
    t = x.shape[0]
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    h = norm_before(lp.wqkv, x, lp.attn_norm, eps, offset)
    with jax.named_scope("qkv_proj"):
        qkv = _project(h, lp.wqkv, lora, "wqkv", rows)
        if lp.bqkv is not None:
            qkv = qkv + lp.bqkv
    q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    q = q.reshape(t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
    if lp.q_norm is not None:
        q = norm_before(lp.wqkv, q, lp.q_norm, eps, offset)
        k = norm_before(lp.wqkv, k, lp.k_norm, eps, offset)
    with jax.named_scope("rope"):
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(q: Float[Array, "T H hd"], cache: KVCache, md: AttentionMetadata, cfg: ModelConfig,
           attention_fn: AttentionFn, window: int | None = None) -> Float[Array, "T Q"]:
    """The queries' attention through the block tables (the step's K/V already in
    `cache`), to the last `window` keys where the layer slides: [T, q_size]."""
    with jax.named_scope("attention"):
        o = attention_fn(
            fold_layer_scales(q, cache), cache.k, cache.v, md.seq_lens, md.block_tables, md.query_start_loc,
            md.num_seqs, sm_scale=cfg.sm_scale, sliding_window=window, soft_cap=cfg.attn_logit_softcap,
            common_prefix_blocks=md.common_prefix_blocks, k_scale=cache.k_scale, v_scale=cache.v_scale,
            cache_dtype=cache.dtype,
        )
    return unfold_layer_scales(o, cache).reshape(q.shape[0], cfg.q_size)


def attention_output(lp: LayerParams, o: Float[Array, "T Q"], cfg: ModelConfig, axis: MeshAxes = None,
                     lora: LayerLoRA | None = None, rows: Int[Array, ""] | None = None) -> Float[Array, "T D"]:
    """The attention sublayer's output projection of the heads' outputs `o` and (Gemma)
    its output norm; the caller adds the residual. `rows`: the real rows (the rest pad)."""
    with jax.named_scope("o_proj"):
        out = all_reduce(_project(o, lp.wo, lora, "wo", rows), axis)
    if lp.attn_post_norm is not None:
        out = norm_before(lp.wo, out, lp.attn_post_norm, cfg.rms_norm_eps, cfg.norm_offset)
    return out


def _project(x: Float[Array, "T K"], w, lora: LayerLoRA | None, field: str, rows: Int[Array, ""] | None = None
             ) -> Float[Array, "T N"]:
    """x's projection by `w`, plus the tokens' adapters' products where there are adapters.
    `rows`: the step's real tokens (the kernel leaves the bucket's padding rows zero)."""
    y = linear(x, w, rows=rows)
    return y if lora is None else lora.add(field, x, y)


def mlp_block(lp: LayerParams, h: Float[Array, "T D"], cfg: ModelConfig, axis: MeshAxes = None,
              moe: bool = False, lora: LayerLoRA | None = None, rows: Int[Array, ""] | None = None
              ) -> Float[Array, "T D"]:
    """Gated feed-forward sublayer, SwiGLU or (Gemma) GeGLU with tanh GELU, or (`moe`) a
    mixture of such experts (jaxllm.models.moe), of the normed input `h`; Gemma's output
    norm; the caller adds the residual. `rows`: the step's real tokens (packed
    projections leave the bucket's padding rows zero)."""
    with jax.named_scope("moe" if moe else "mlp"):
        if moe:
            out = moe_mlp(lp, h, cfg, axis)
        else:
            out = all_reduce(_project(_gated_up(lp, h, cfg, lora, rows), lp.w_down, lora, "w_down", rows), axis)
    if lp.mlp_post_norm is not None:
        out = norm_before(lp.w_down, out, lp.mlp_post_norm, cfg.rms_norm_eps, cfg.norm_offset)
    return out


def _gated_up(lp: LayerParams, h: Float[Array, "T D"], cfg: ModelConfig, lora: LayerLoRA | None,
              rows: Int[Array, ""] | None) -> Float[Array, "T F"]:
    """act(gate) * up of the normed `h`: by the gate/up kernel itself where its panels
    allow (formats.Panels.gates: the sums of gate and up never written out), else the
    projection (and its adapters), then the activation."""
    if lora is None and Panels.gates(lp.w_gate_up, h.shape[0]):
        return Panels.gated_matmul(h, lp.w_gate_up, cfg.hidden_act, rows)
    return gated_before(lp.w_down, _project(h, lp.w_gate_up, lora, "w_gate_up", rows), cfg.hidden_act)


def compute_logits(
    params: ModelParams, hidden: Float[Array, "S D"], cfg: ModelConfig, axis: MeshAxes = None,
    rows: Int[Array, ""] | None = None,
) -> Float[Array, "S V"]:
    """float32 logits over the whole vocabulary (gathered from the shards of `axis`).
    `rows`: only the first `rows` of `hidden` are real (a step's sample rows, padded to
    its bucket): a packed output projection multiplies those alone and gives zeros for
    the rest (at 32 clients a mixed step samples ~33 rows of a 64-row bucket)."""
    with jax.named_scope("logits"):
        head = params.embed if params.lm_head is None else params.lm_head
        normed = norm_before(head, hidden, params.final_norm, cfg.rms_norm_eps, cfg.norm_offset)
        return _logits(params, normed, cfg, axis, rows)


def _logits(params: ModelParams, h: Float[Array, "S D"], cfg: ModelConfig, axis: MeshAxes,
            rows: Int[Array, ""] | None) -> Float[Array, "S V"]:
    embed = params.embed
    if params.lm_head is None and isinstance(embed, PackedWeight):  # tied, packed in the table's place
        logits = linear(h, embed, preferred_element_type=jnp.float32, rows=rows)
    elif params.lm_head is None and isinstance(embed, QuantizedWeight) and embed.activations == "int8":
        logits = linear(h, embed.transposed(), preferred_element_type=jnp.float32)  # int8 inputs, as packed
    elif params.lm_head is None:  # tied (a quantized embedding dequantized: the dequantized table's very sums)
        embed = dequantize(embed) if isinstance(embed, QuantizedWeight) else embed
        logits = jnp.einsum("sd,vd->sv", h.astype(embed.dtype), embed, preferred_element_type=jnp.float32)
    else:
        logits = linear(h, params.lm_head, preferred_element_type=jnp.float32, rows=rows)
    logits = apply_soft_cap(logits, cfg.final_logit_softcap)
    return logits if axis is None else jax.lax.all_gather(logits, axis, axis=1, tiled=True)


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class OutputRows:
    """The rows a step reads the last layer's hidden states of: `indices` (each sample
    row's token row, padded to the bucket; the first `count` are real), and whether it
    needs `every` row too (prompt logprobs score each prompt token)."""

    indices: Int[Array, " S"]
    count: Int[Array, ""]
    every: Bool[Array, ""]


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class HiddenRows:
    """The last layer's hidden states (before the final norm) of the OutputRows'
    `indices`, and of every token where OutputRows.every (zeros otherwise)."""

    rows: Float[Array, "S D"]
    every: Float[Array, "T D"]


@struct.dataclass
class ImageRows:
    """A vision-language model's image embeddings for a step: the encoder cache's
    table (jaxllm.worker.image_encoder) and, per token, its row there (-1: a text token)."""

    table: Float[Array, "N D"]
    rows: Int[Array, " T"]
    blocks: ImageBlocks | None = None  # Gemma 3: the step's images, whose tokens attend both ways

    def place(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        """`x` with each image token's embedding taken from the table."""
        found = self.table[jnp.maximum(self.rows, 0)].astype(x.dtype)
        return jnp.where((self.rows >= 0)[:, None], found, x)


def forward_hidden(
    params: ModelParams,
    rope: RopeTable,
    kv_caches: tuple[KVCache, ...],
    input_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    md: AttentionMetadata | tuple[AttentionMetadata, ...],
    *,
    cfg: ModelConfig,
    attention_fn: AttentionFn,
    axis: MeshAxes = None,
    lora: LoRAInputs | None = None,
    images: ImageRows | None = None,
) -> tuple[Float[Array, "T D"], tuple[KVCache, ...]]:
    """Hidden states of every token (before the final norm), and the updated caches.
    They are of the activation dtype of the weights (float32 on the CPU platform for
    bfloat16 weights too; jaxllm.platform.activation_dtype), whatever the caches hold.

    One `md` and a cache per layer, or (a hybrid KV cache, jaxllm.kv_cache_groups) one
    `md` per KV cache group and a cache per slot: layer i reads its group's block
    tables and writes its slot's cache. `lora`: the adapters' slots and each token's
    slot (jaxllm.models.lora). `images`: a vision-language model's image embeddings in
    place of its image tokens (`ImageRows`)."""
    return _layers(params, rope, kv_caches, input_ids, positions, md, cfg, attention_fn, axis, lora, None, images)


def forward_rows(
    params: ModelParams,
    rope: RopeTable,
    kv_caches: tuple[KVCache, ...],
    input_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    md: AttentionMetadata | tuple[AttentionMetadata, ...],
    out: OutputRows,
    *,
    cfg: ModelConfig,
    attention_fn: AttentionFn,
    axis: MeshAxes = None,
    lora: LoRAInputs | None = None,
    images: ImageRows | None = None,
) -> tuple[HiddenRows, tuple[KVCache, ...]]:
    """forward_hidden for a step that reads the rows `out` names: the last layer writes
    every token's K/V and attends for every token, but (unless `out.every`) its output
    projection and MLP run on those rows alone, as llama.cpp's last layer does (a
    prefill chunk samples from one row of hundreds). Row by row forward_hidden's
    arithmetic, where the projections' backend sums a row alike at any row count (the
    cpu kernels; the norms' sums always do: `row_sums`)."""
    return _layers(params, rope, kv_caches, input_ids, positions, md, cfg, attention_fn, axis, lora, out, images)


def embed_input(params: ModelParams, input_ids: Int[Array, " T"], cfg: ModelConfig, axis: MeshAxes
                ) -> Float[Array, "T D"]:
    """The tokens' embeddings as the first layer takes them: Gemma's scaled by
    sqrt(hidden) in the embedding's dtype (as HF computes it), in the activation dtype.
    `axis`: the mesh axis (or axes) the vocabulary is sharded over."""
    x = embed_tokens(params.embed, input_ids, axis)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size**0.5, dtype=x.dtype)
    return x.astype(activation_dtype(params.final_norm.dtype))


def rope_rows(rope: RopeTable, positions: Int[Array, " T"]) -> tuple[tuple, tuple]:
    """(cos, sin) of `positions` for the full layers and for the sliding ones (Gemma 3's
    own RoPE; the same pair elsewhere)."""
    full = rope.cos[positions], rope.sin[positions]
    return full, full if rope.local_cos is None else (rope.local_cos[positions], rope.local_sin[positions])


def decoder_layer(i: int, lp: LayerParams, x: Float[Array, "T D"], ropes: tuple[tuple, tuple], cache: KVCache,
                  md: AttentionMetadata, cfg: ModelConfig, attention_fn: AttentionFn, axis: MeshAxes,
                  lora: LayerLoRA | None, images: ImageRows | None = None) -> tuple[Float[Array, "T D"], KVCache]:
    """Layer `i` (its kind, window and RoPE from `cfg`) over `x`: attention through
    `cache` (the layer's slot) and `md` (its group's), then the MLP."""
    o, cache = self_attention(lp, x, *ropes[cfg.is_sliding(i)], cache, md, cfg, attention_fn, cfg.layer_window(i),
                              lora, images)
    return finish_layer(lp, x, o, md.num_tokens, lora, cfg=cfg, axis=axis, moe=cfg.is_moe(i)), cache


def _layers(params, rope, kv_caches, input_ids, positions, md, cfg: ModelConfig, attention_fn: AttentionFn,
            axis: MeshAxes, lora: LoRAInputs | None, out: OutputRows | None, images: ImageRows | None = None):
    """forward_hidden's layers; with `out`, forward_rows' last one."""
    x = embed_input(params, input_ids, cfg, axis)
    if images is not None:
        x = images.place(x)
    ropes = rope_rows(rope, positions)
    groups = cfg.kv_cache_groups(hybrid=isinstance(md, tuple))
    mds = md if isinstance(md, tuple) else (md,)
    if len(mds) != groups.num_groups or len(kv_caches) != groups.group_size:
        raise ValueError(f"{len(mds)} attention metadata and {len(kv_caches)} caches for {groups}")
    caches = list(kv_caches)
    last = len(params.layers) - 1
    for i, lp in enumerate(params.layers):
        slot, md_i = groups.slot_of(i), mds[groups.group_of(i)]
        layer_lora = None if lora is None else lora.layer(i)
        with jax.named_scope(f"layer{i}"):  # a profile reads layer{i}/attention, layer{i}/mlp, ...
            if out is not None and i == last:
                o, caches[slot] = self_attention(lp, x, *ropes[cfg.is_sliding(i)], caches[slot], md_i, cfg,
                                                 attention_fn, cfg.layer_window(i), layer_lora, images)
                finish = functools.partial(finish_layer, lp, cfg=cfg, axis=axis, moe=cfg.is_moe(i))
                return _last_layer_rows(finish, x, o, md_i.num_tokens, layer_lora, out), tuple(caches)
            x, caches[slot] = decoder_layer(i, lp, x, ropes, caches[slot], md_i, cfg, attention_fn, axis, layer_lora,
                                            images)
    return x, tuple(caches)


def finish_layer(lp: LayerParams, x: Float[Array, "T D"], o: Float[Array, "T Q"], rows: Int[Array, ""],
                  lora: LayerLoRA | None, *, cfg: ModelConfig, axis: MeshAxes, moe: bool) -> Float[Array, "T D"]:
    """A layer after its attention: the output projection, the residual added and the
    MLP's norm (one pass where the projections are packed: add_norm_before), the MLP,
    its residual."""
    x, h = add_norm_before(lp.w_gate_up, x, attention_output(lp, o, cfg, axis, lora, rows), lp.mlp_norm,
                           cfg.rms_norm_eps, cfg.norm_offset)
    return x + mlp_block(lp, h, cfg, axis, moe=moe, lora=lora, rows=rows)


def _last_layer_rows(finish, x: Float[Array, "T D"], o: Float[Array, "T Q"], num_tokens: Int[Array, ""],
                     lora: LayerLoRA | None, out: OutputRows) -> HiddenRows:
    """The last layer's `finish` on every row where `out.every`, else on `out`'s rows."""
    def every_row(x, o):
        h = finish(x, o, num_tokens, lora)
        return HiddenRows(h[out.indices], h)

    def sample_rows(x, o):
        taken = None if lora is None else lora.take(out.indices)
        return HiddenRows(finish(x[out.indices], o[out.indices], out.count, taken), jnp.zeros_like(x))

    return jax.lax.cond(out.every, every_row, sample_rows, x, o)
