"""Per-row sampling parameters of one step, as device arrays (one pytree).

Rows are the step's sequences, padded to the sequence bucket; padding rows are greedy
and their samples are discarded. The `any_*` flags select the optional parts of the
sampler at run time (lax.cond), so a batch that does not ask for sorting or penalties
does not pay for them and no flag combination needs its own compilation.
"""

from __future__ import annotations

from flax import struct
from jaxtyping import Array, Bool, Float, Int, UInt32


@struct.dataclass
class SamplingMetadata:
    temperature: Float[Array, " S"]  # 0 = greedy
    top_k: Int[Array, " S"]  # 0 = off
    top_p: Float[Array, " S"]
    min_p: Float[Array, " S"]
    presence_penalty: Float[Array, " S"]
    frequency_penalty: Float[Array, " S"]
    repetition_penalty: Float[Array, " S"]
    seeds: UInt32[Array, "S 2"]  # the request's 64-bit seed as two 32-bit halves
    output_index: Int[Array, " S"]  # index of the token being sampled among the outputs
    bias_token_ids: Int[Array, "S NB"]  # logit_bias (and -inf for stop tokens under min_tokens)
    bias_values: Float[Array, "S NB"]  # 0 in unused entries
    history_rows: Int[Array, " S"]  # rows of the token history (for penalties)
    num_prompt_tokens: Int[Array, " S"]
    num_known_tokens: Int[Array, " S"]  # tokens in the history row after this step's inputs
    # structured outputs: bit t % 32 of word t // 32 allows token t (all ones: unconstrained)
    token_bitmask: Int[Array, "S W"]
    all_greedy: Bool[Array, ""]
    any_top_k_top_p: Bool[Array, ""]
    any_min_p: Bool[Array, ""]
    any_penalties: Bool[Array, ""]
    any_logprobs: Bool[Array, ""]
    any_token_bitmask: Bool[Array, ""]
    # Any nonzero bias entry (logit_bias, or stop tokens held back by min_tokens); when
    # False the bias scatter (and the copy of the logits it forces) is skipped.
    any_logit_bias: Bool[Array, ""] = True
    # Any beam search row: each row's best continuations are ranked (SamplerOutput.beam_*)
    any_beam: Bool[Array, ""] = False


@struct.dataclass
class SamplerOutput:
    token_ids: Int[Array, " S"]
    # Logprobs of the raw model distribution (zeros unless any_logprobs).
    sampled_logprob: Float[Array, " S"]
    sampled_rank: Int[Array, " S"]  # 1 = most likely
    top_token_ids: Int[Array, "S K"]
    top_logprobs: Float[Array, "S K"]
    # beam search (zeros unless any_beam): each row's best continuations by log_softmax of
    # the raw logits plus the logit bias, transformers' order (jaxllm.core.beam_search)
    beam_token_ids: Int[Array, "S B"]
    beam_logprobs: Float[Array, "S B"]
