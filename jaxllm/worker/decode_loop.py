"""Multi-step decode: several decode steps in one device call (issue 57).

When every running sequence decodes one token and no request can be admitted, the
scheduler may hand the runner up to K steps at once (`SchedulerOutput.decode_steps`).
The runner then calls `packed_decode_loop`: one `lax.while_loop` over `model_step`, in
which each iteration's sampled tokens become the next iteration's inputs on the device
(`advance`: positions, KV cache slots from the block tables, sequence lengths and
output indices move on by one), so K tokens per sequence cost one dispatch and one
read-back instead of K of each.

A row stops when it samples one of its stop tokens at or past min_tokens, or when it
has taken the steps the scheduler gave it KV slots for (`DecodeLimits.max_steps`); a
stopped row writes no more K/V (its slots point at the null block) and its samples
are not counted. The loop ends after `num_steps` iterations or once no row is left.
Under async scheduling the next call is dispatched before the host has seen this one's
tokens, counting on every row to take all its steps: a row that stopped early leaves
its stop token where that call reads its input, and a row whose input is its stop
token stops at once (it costs that call one step, as a single step would).
The device knows up to `STOP_WIDTH` stop tokens per row: a row with more may run past
one, and the host, which checks every stop condition, drops what follows it. Each
iteration computes exactly what a single step would, so the tokens are those of
single steps.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int

from jaxllm.attention.kv_cache import KVCache
from jaxllm.attention.metadata import AttentionMetadata
from jaxllm.models.lora import LoRAWeights
from jaxllm.models.params import ModelParams
from jaxllm.models.rope import RopeTable
from jaxllm.sample.metadata import SamplerOutput
from jaxllm.worker.packing import PackLayout
from jaxllm.worker.step import StepInputs, model_step, set_tokens

STOP_WIDTH = 8  # stop token ids per row the device checks (EOS and the first stop_token_ids)


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class DecodeLimits:
    """Per sequence row (padded to the bucket), what ends its loop."""

    max_steps: Int[Array, " S"]  # steps the row may take: the KV slots it holds (0: padding)
    stop_token_ids: Int[Array, "S NS"]  # tokens that end it (-1: none), counted once
    min_tokens: Int[Array, " S"]  # outputs before a stop token ends it
    num_steps: Int[Array, ""]  # the loop's bound (at most the compiled number of steps)


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class LoopInputs:
    step: StepInputs  # the first iteration's inputs: one token per sequence row
    limits: DecodeLimits


@typing.no_type_check  # a pytree: tree_map fills it with anything (abstract leaves too)
@struct.dataclass
class LoopOutput:
    sampled: SamplerOutput  # each field [K, S, ...]: iteration j's samples at [j]
    num_tokens: Int[Array, " S"]  # the samples each row counts: its first num_tokens iterations
    num_steps: Int[Array, ""]  # the iterations the loop ran


def advance(inputs: StepInputs, tokens: Int[Array, " S"], alive: Bool[Array, " S"], block_size: int,
            unused_row: int) -> StepInputs:
    """The next decode step's inputs: each live row's sampled token at its next
    position, its K/V slot read from its block table; rows not alive stay where they
    are and write into the null block. Token i is row i's (a decode step's layout)."""
    t, s = inputs.input_ids.shape[0], inputs.logits_indices.shape[0]
    row = jnp.minimum(jnp.arange(t), s - 1)
    live = (jnp.arange(t) < inputs.num_logit_rows) & alive[row]
    positions = jnp.where(live, inputs.positions + 1, inputs.positions)

    def attention(md: AttentionMetadata) -> AttentionMetadata:
        column = jnp.minimum(positions // block_size, md.block_tables.shape[1] - 1)
        slots = md.block_tables[row, column] * block_size + positions % block_size
        return md.replace(slot_mapping=jnp.where(live, slots, 0), seq_lens=md.seq_lens + alive)

    attn = tuple(map(attention, inputs.attn)) if isinstance(inputs.attn, tuple) else attention(inputs.attn)
    sampling = inputs.sampling.replace(output_index=inputs.sampling.output_index + alive,
                                       num_known_tokens=inputs.sampling.num_known_tokens + alive)
    return inputs.replace(
        input_ids=jnp.where(live, tokens[row], inputs.input_ids),
        positions=positions,
        from_history=jnp.zeros_like(inputs.from_history),
        attn=attn,
        sampling=sampling,
        sampled_history_rows=jnp.where(alive, inputs.sampled_history_rows, unused_row),
        any_prompt_logprobs=jnp.zeros_like(inputs.any_prompt_logprobs),
    )


def stops(limits: DecodeLimits, output_index: Int[Array, " S"], tokens: Int[Array, " S"]) -> Bool[Array, " S"]:
    """Rows whose output `output_index` (0: the first) ends them: one of their stop
    tokens, once min_tokens outputs exist (with it)."""
    hit = (tokens[:, None] == limits.stop_token_ids).any(axis=-1)
    return hit & (output_index >= 0) & (output_index + 1 >= limits.min_tokens)


def decode_loop(params: ModelParams, rope: RopeTable, kv_caches: tuple[KVCache, ...], history: Int[Array, "R L"],
                inputs: LoopInputs, lora: LoRAWeights | None = None, *, max_steps: int, block_size: int,
                **step_kwargs) -> tuple[tuple[KVCache, ...], Int[Array, "R L"], LoopOutput]:
    """Up to `max_steps` (static) decode steps of `model_step` in one while loop."""
    step_fn = functools.partial(model_step, **step_kwargs)
    limits, first = inputs.limits, inputs.step
    s = first.logits_indices.shape[0]
    shapes = jax.eval_shape(step_fn, params, rope, kv_caches, history, first, lora)[2].sampled
    buffers = jax.tree.map(lambda a: jnp.zeros((max_steps, *a.shape), a.dtype), shapes)
    alive = (jnp.arange(s) < first.num_logit_rows) & (limits.max_steps > 0)
    bound = jnp.minimum(limits.num_steps, max_steps)

    def cond(carry):
        j, *_, alive = carry
        return (j < bound) & alive.any()

    def body(carry):
        j, caches, hist, step, outs, counts, alive = carry
        caches, hist, out = step_fn(params, rope, caches, hist, step, lora)
        # A row whose input is its stop token ended in the call before, whose tokens the host had
        # not seen when it scheduled this one (async scheduling): it counts nothing from here.
        # (The history holds every input by now; read after the step's write, it is not copied.)
        inputs = hist[step.sampling.history_rows, jnp.maximum(step.sampling.num_known_tokens - 1, 0)]
        alive = alive & ~stops(limits, step.sampling.output_index - 1, inputs)
        outs = jax.tree.map(lambda buf, x: buf.at[j].set(x), outs, out.sampled)
        tokens = out.sampled.token_ids
        counts = counts + alive
        alive = alive & ~stops(limits, step.sampling.output_index, tokens) & (counts < limits.max_steps)
        return j + 1, caches, hist, advance(step, tokens, alive, block_size, history.shape[0] - 1), outs, counts, alive

    carry = (jnp.int32(0), kv_caches, history, first, buffers, jnp.zeros(s, jnp.int32), alive)
    j, kv_caches, history, _, outs, counts, _ = jax.lax.while_loop(cond, body, carry)
    # A row that stopped early leaves a stop token where the host, not knowing yet, expects its last
    # one: a call dispatched meanwhile reads it as its input and stops the row at once.
    stopped = counts < limits.max_steps
    history = set_tokens(history, jnp.where(stopped, first.sampled_history_rows, history.shape[0] - 1),
                         first.sampling.num_known_tokens + limits.max_steps - 1, limits.stop_token_ids[:, 0])
    return kv_caches, history, LoopOutput(outs, counts, j)


def packed_decode_loop(params: ModelParams, rope: RopeTable, kv_caches: tuple[KVCache, ...],
                       history: Int[Array, "R L"], packed: Int[Array, " P"], token_bitmask: Int[Array, "S W"],
                       lora: LoRAWeights | None = None, *, layout: PackLayout, **kwargs):
    """`decode_loop` on its inputs as the host sends them (jaxllm.worker.packing)."""
    return decode_loop(params, rope, kv_caches, history, layout.unpack(packed, (token_bitmask,)), lora, **kwargs)
