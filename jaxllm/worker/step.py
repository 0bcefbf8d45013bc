"""The jitted step: forward over the paged cache, then sampling, in one device call.

Its inputs are one pytree (StepInputs) of arrays padded to a (tokens, sequences)
bucket; the KV caches and the token history are donated, so XLA updates them in place.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from jaxllm.attention.backends import AttentionFn
from jaxllm.attention.image_blocks import ImageBlocks
from jaxllm.attention.kv_cache import KVCache
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.models.llama import ImageRows, OutputRows, compute_logits
from jaxllm.models.lora import LoRAInputs, LoRAWeights
from jaxllm.models.params import ModelParams
from jaxllm.models.pipeline import model_functions
from jaxllm.models.rope import RopeTable
from jaxllm.sample.metadata import SamplerOutput, SamplingMetadata
from jaxllm.sample.sampler import ArgmaxFn, ScoresFn, argmax, compute_logprobs, num_top_logprobs, sample
from jaxllm.worker.packing import PackLayout

# StepInputs leaves not packed (jaxllm.worker.packing): the token bitmask is [S, V/32] and
# stays on the device between steps that constrain no row
SEPARATE_INPUTS = ("token_bitmask",)


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class StepInputs:
    input_ids: Int[Array, " T"]
    positions: Int[Array, " T"]
    history_rows: Int[Array, " T"]  # token history row of each token (padding: an unused row)
    # tokens the host does not know yet (async scheduling: sampled by the step before, which
    # wrote them into the history): read from the history at their row and position
    from_history: Bool[Array, " T"]
    attn: AttentionMetadata | tuple[AttentionMetadata, ...]  # one per KV cache group where there are several
    logits_indices: Int[Array, " R"]  # each sample row's token (a sequence's last; a drafted one's last 1 + k)
    # the history row each sample row's token goes to, at its sequence's next position (an
    # unused row where the row samples nothing: a prompt's chunk before its last, padding)
    sampled_history_rows: Int[Array, " R"]
    num_logit_rows: Int[Array, ""]  # how many of logits_indices are real (the rest pad the bucket)
    sampling: SamplingMetadata
    prompt_logprob_targets: Int[Array, " T"]  # next prompt token to score at each row, -1 if none
    any_prompt_logprobs: Bool[Array, ""]
    lora_slots: Int[Array, " T"] | None = None  # each token's adapter slot (0: none); None without LoRA
    # a vision-language model's: each token's row in the image table (-1: text); None for text models
    image_rows: Int[Array, " T"] | None = None
    image_blocks: ImageBlocks | None = None  # Gemma 3's: the step's images, whose tokens attend both ways


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class PromptLogprobs:
    """Per token row: logprob and rank of the next prompt token, and the top-k."""

    logprob: Float[Array, " T"]
    rank: Int[Array, " T"]
    top_token_ids: Int[Array, "T K"]
    top_logprobs: Float[Array, "T K"]


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class StepOutput:
    sampled: SamplerOutput
    prompt_logprobs: PromptLogprobs


def prompt_logprobs(params: ModelParams, hidden: Float[Array, "T D"], targets: Int[Array, " T"], cfg: ModelConfig,
                    scores_fn: ScoresFn = compute_logprobs, logits_fn=compute_logits) -> PromptLogprobs:
    """Rows with a negative target are not scored (their values are unspecified)."""
    return PromptLogprobs(*scores_fn(logits_fn(params, hidden, cfg), targets))


def _no_prompt_logprobs(params, hidden, targets, cfg):
    t, k = hidden.shape[0], num_top_logprobs(cfg.vocab_size)
    return PromptLogprobs(
        jnp.zeros((t,), jnp.float32), jnp.zeros((t,), jnp.int32),
        jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32),
    )


def set_tokens(history: Int[Array, "R L"], rows: Int[Array, " N"], positions: Int[Array, " N"],
               tokens: Int[Array, " N"]) -> Int[Array, "R L"]:
    """history[rows, positions] = tokens, out-of-range rows dropped. A lone token as two,
    the second out of range: XLA makes a one-element scatter a dynamic-update-slice, and
    copied the whole history around it (twice a one-token step), as it did the KV cache
    (jaxllm.attention.kv_cache.write_kv_cache)."""
    if rows.shape[0] == 1:
        rows = jnp.concatenate([rows, jnp.full((1,), history.shape[0], rows.dtype)])
        positions, tokens = jnp.concatenate([positions, positions]), jnp.concatenate([tokens, tokens])
    return history.at[rows, positions].set(tokens, mode="drop")


def model_step(
    params: ModelParams,
    rope: RopeTable,
    kv_caches: tuple[KVCache, ...],
    history: Int[Array, "R L"],
    inputs: StepInputs,
    lora: LoRAWeights | None = None,
    image_table: Float[Array, "N D"] | None = None,
    *,
    cfg: ModelConfig,
    attention_fn: AttentionFn,
    argmax_fn: ArgmaxFn = argmax,
    scores_fn: ScoresFn = compute_logprobs,
    mesh: Mesh | None = None,
    lora_kernel: str = "xla",
) -> tuple[tuple[KVCache, ...], Int[Array, "R L"], StepOutput]:
    """One engine step; with a `mesh`, the model tensor-parallel over it
    (jaxllm.models.parallel), or pipelined over its stages (jaxllm.models.pipeline), and
    the sampling on the gathered logits. `lora`: the
    adapters' device slots, each token applying the one `inputs.lora_slots` names.
    `image_table`: a vision-language model's encoder cache, each image token's
    embedding read at its `inputs.image_rows` row."""
    forward, logits_fn = model_functions(cfg, attention_fn, mesh)
    extra = {}
    if lora is not None:
        extra["lora"] = LoRAInputs.make(lora, inputs.lora_slots, params.final_norm.dtype, lora_kernel)
    if image_table is not None:
        extra["images"] = ImageRows(image_table, inputs.image_rows, inputs.image_blocks)
    # the tokens the host knows into the history; the others are there already (the step before wrote
    # them) and are read back after the write, so nothing reads the history before its update (XLA
    # copied the whole history for such a reader at one-token steps)
    history = set_tokens(history, jnp.where(inputs.from_history, history.shape[0], inputs.history_rows),
                         inputs.positions, inputs.input_ids)
    input_ids = jnp.where(inputs.from_history, history[inputs.history_rows, inputs.positions], inputs.input_ids)
    out = OutputRows(inputs.logits_indices, inputs.num_logit_rows, inputs.any_prompt_logprobs)
    hidden, kv_caches = forward(params, rope, kv_caches, input_ids, inputs.positions, inputs.attn, out, **extra)
    logits = logits_fn(params, hidden.rows, cfg, rows=inputs.num_logit_rows)
    sampled = sample(logits, history, inputs.sampling, argmax_fn=argmax_fn, scores_fn=scores_fn)
    # each sampled token at its position, where the next step reads it if its host does not yet know it
    history = set_tokens(history, inputs.sampled_history_rows, inputs.sampling.num_known_tokens, sampled.token_ids)
    prompt_lp = jax.lax.cond(
        inputs.any_prompt_logprobs,
        lambda h, t: prompt_logprobs(params, h, t, cfg, scores_fn, logits_fn),
        lambda h, t: _no_prompt_logprobs(params, h, t, cfg),
        hidden.every,
        inputs.prompt_logprob_targets,
    )
    return kv_caches, history, StepOutput(sampled, prompt_lp)


def packed_step(params: ModelParams, rope: RopeTable, kv_caches: tuple[KVCache, ...], history: Int[Array, "R L"],
                packed: Int[Array, " P"], token_bitmask: Int[Array, "S W"], lora: LoRAWeights | None = None,
                image_table: Float[Array, "N D"] | None = None, *,
                layout: PackLayout, **kwargs) -> tuple[tuple[KVCache, ...], Int[Array, "R L"], StepOutput]:
    """`model_step` on its inputs as the host sends them: one int32 buffer of `layout`
    and the token bitmask (one transfer a step where ~40 arrays were ~40)."""
    return model_step(params, rope, kv_caches, history, layout.unpack(packed, (token_bitmask,)), lora, image_table,
                      **kwargs)
