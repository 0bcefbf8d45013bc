"""The sampler: logits [S, V] -> one token per row, on device.

Order as in vLLM: the structured-output token bitmask, logit bias, penalties
(presence / frequency over the output tokens, repetition over prompt and output
tokens), greedy argmax, or temperature, top-k / top-p, min-p and a draw. The draw is an inverse-CDF lookup with one uniform per row
from the request's seed and output index, so a seeded request draws the same tokens
whatever it is batched with (and costs one cumsum instead of V Gumbel samples).
Logprobs are of the raw model distribution. A step with beam search rows also ranks
each row's best continuations (`beam_candidates`: log_softmax plus the logit bias).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxllm.cpu_kernels import load_kernels
from jaxllm.sample.metadata import SamplerOutput, SamplingMetadata
from jaxllm.sampling_params import BEAM_CANDIDATES, MAX_LOGPROBS

_NEG_INF = float("-inf")
ARGMAX_TARGET = "jaxllm_argmax_f32"  # registered by jaxllm.cpu_kernels.load_kernels
TOKEN_SCORES_TARGET = "jaxllm_token_scores_f32"


def apply_token_bitmask(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    """-inf where the row's bitmask clears the token's bit (a grammar forbids it)."""
    words = md.token_bitmask  # [S, W], W * 32 >= V
    bits = (words[:, :, None] >> jnp.arange(32, dtype=words.dtype)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[1]].astype(bool)
    return jnp.where(allowed, logits, _NEG_INF)


def apply_logit_bias(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, md.bias_token_ids].add(md.bias_values)


def token_counts(
    history: Int[Array, "R L"], md: SamplingMetadata, vocab_size: int
) -> tuple[Float[Array, "S V"], Float[Array, "S V"]]:
    """(output token counts, prompt token presence) per row, from the token history."""
    tokens = history[md.history_rows]  # [S, L]
    pos = jnp.arange(tokens.shape[1])[None, :]
    known = pos < md.num_known_tokens[:, None]
    in_prompt = pos < md.num_prompt_tokens[:, None]
    rows = jnp.arange(tokens.shape[0])[:, None]
    zeros = jnp.zeros((tokens.shape[0], vocab_size), jnp.float32)
    output_counts = zeros.at[rows, tokens].add((known & ~in_prompt).astype(jnp.float32))
    prompt_seen = zeros.at[rows, tokens].max((known & in_prompt).astype(jnp.float32))
    return output_counts, prompt_seen


def apply_penalties(logits, history, md: SamplingMetadata):
    output_counts, prompt_seen = token_counts(history, md, logits.shape[1])
    seen = (output_counts > 0) | (prompt_seen > 0)
    rep = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0)


def apply_top_k_top_p(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    """Keep the k largest logits, then, of those (renormalized), the smallest set whose
    probability reaches top_p; the most likely token always stays."""
    vocab = logits.shape[1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], desc, _NEG_INF)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    keep = mass_before < md.top_p[:, None]
    last_kept = jnp.maximum(keep.sum(axis=-1) - 1, 0)
    pth = jnp.take_along_axis(desc, last_kept[:, None], axis=-1)
    return jnp.where(logits < jnp.maximum(kth, pth), _NEG_INF, logits)


def apply_min_p(logits: Float[Array, "S V"], md: SamplingMetadata) -> Float[Array, "S V"]:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = md.min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(probs < threshold, _NEG_INF, logits)


def row_uniforms(md: SamplingMetadata) -> Float[Array, " S"]:
    """One uniform in (0, 1] per row from (seed, output index)."""

    def one(seed, index):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), index)
        return 1.0 - jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(md.seeds, md.output_index)


def draw(logits: Float[Array, "S V"], md: SamplingMetadata, uniforms: Float[Array, " S"]) -> Int[Array, " S"]:
    """Each row's token drawn by inverting its CDF at `uniforms` (row_uniforms)."""
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)[:, None]
    logits = logits / temperature
    logits = jax.lax.cond(md.any_top_k_top_p, apply_top_k_top_p, lambda x, _: x, logits, md)
    logits = jax.lax.cond(md.any_min_p, apply_min_p, lambda x, _: x, logits, md)
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    target = uniforms * cdf[:, -1]
    return jnp.minimum((cdf < target[:, None]).sum(axis=-1), logits.shape[1] - 1).astype(jnp.int32)


def num_top_logprobs(vocab_size: int) -> int:
    return min(MAX_LOGPROBS, vocab_size)


ScoresFn = Callable[[Float[Array, "S V"], Int[Array, " S"]],
                    tuple[Float[Array, " S"], Int[Array, " S"], Int[Array, "S K"], Float[Array, "S K"]]]


def compute_logprobs(logits: Float[Array, "S V"], token_ids: Int[Array, " S"]):
    """Per row: the log-probability of token_ids and its rank (1 = most likely), and
    the top num_top_logprobs tokens with their log-probabilities (a ScoresFn). A row
    whose token id is negative is not meant to be scored: its values are unspecified."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    sampled = jnp.take_along_axis(logprobs, jnp.maximum(token_ids, 0)[:, None], axis=-1)[:, 0]
    rank = (logprobs > sampled[:, None]).sum(axis=-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs(logits.shape[1]))
    return sampled, rank, top_ids.astype(jnp.int32), top_logprobs


def _no_logprobs(logits, token_ids):
    s, k = logits.shape[0], num_top_logprobs(logits.shape[1])
    return (
        jnp.zeros((s,), jnp.float32),
        jnp.zeros((s,), jnp.int32),
        jnp.zeros((s, k), jnp.int32),
        jnp.zeros((s, k), jnp.float32),
    )


def beam_candidates(logits: Float[Array, "S V"], md: SamplingMetadata) -> tuple[Int[Array, "S B"], Float[Array, "S B"]]:
    """Beam search: each row's BEAM_CANDIDATES best tokens by log-probability, the logit
    bias (min_tokens' stop-token suppression with it) added after the log_softmax as
    transformers' logits processors are, and those log-probabilities. The host ranks
    a beam's first width + stop tokens of them (SamplingParams.num_beam_candidates)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    logprobs = jax.lax.cond(md.any_logit_bias, apply_logit_bias, lambda x, m: x, logprobs, md)
    values, ids = jax.lax.top_k(logprobs, num_beam_candidates(logits.shape[1]))
    return ids.astype(jnp.int32), values


def num_beam_candidates(vocab_size: int) -> int:
    return min(BEAM_CANDIDATES, vocab_size)


def _no_beam_candidates(logits, md):
    shape = (logits.shape[0], num_beam_candidates(logits.shape[1]))
    return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)


ArgmaxFn = Callable[[Float[Array, "S V"]], Int[Array, " S"]]


def argmax(logits: Float[Array, "S V"]) -> Int[Array, " S"]:
    """jnp.argmax over the last axis (the first index of the maximum) as top_k(1),
    which keeps ties in index order. After the lm_head on XLA:CPU: 4.5 ms at 64x49152,
    against 7 ms for argmax's variadic reduce and 16 ms for a max + first-index min
    (YNNPACK takes the max-reduction and materializes its broadcast)."""
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


def argmax_cpu(logits: Float[Array, "S V"]) -> Int[Array, " S"]:
    """The same as `argmax` (NaN counts as the maximum, as in jnp.argmax), as the C++
    custom call of jaxllm/cpu_kernels/argmax.cc: both threads, one read of the logits
    (64x49152 in well under 1 ms). XLA:CPU, float32; the model runner uses it with the
    `cpu` linear backend, whose kernels it shares."""
    load_kernels()
    if logits.dtype != jnp.float32:
        raise ValueError(f"argmax_cpu needs float32 logits (got {logits.dtype})")
    return jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))(logits)


def token_scores_cpu(logits: Float[Array, "S V"], targets: Int[Array, " S"]):
    """compute_logprobs as the C++ custom call of jaxllm/cpu_kernels/token_scores.cc
    (rows with a negative target are skipped: zeros). One read of each row on every
    thread instead of log_softmax, top_k and a rank count one after another (~200 ms
    at 512 x 49152 on XLA:CPU). XLA:CPU, float32; used with the `cpu` linear backend."""
    load_kernels()
    if logits.dtype != jnp.float32:
        raise ValueError(f"token_scores_cpu needs float32 logits (got {logits.dtype})")
    s, k = logits.shape[0], num_top_logprobs(logits.shape[1])
    out = (jax.ShapeDtypeStruct((s,), jnp.float32), jax.ShapeDtypeStruct((s,), jnp.int32),
           jax.ShapeDtypeStruct((s, k), jnp.int32), jax.ShapeDtypeStruct((s, k), jnp.float32))
    return tuple(jax.ffi.ffi_call(TOKEN_SCORES_TARGET, out)(logits, targets.astype(jnp.int32)))


def sample(
    logits: Float[Array, "S V"], history: Int[Array, "R L"], md: SamplingMetadata, *, argmax_fn: ArgmaxFn = argmax,
    scores_fn: ScoresFn = compute_logprobs,
) -> SamplerOutput:
    """The step's tokens, and the logprobs of the raw logits by `scores_fn` (the one the
    step scores prompt tokens with, so every logprob the engine reports is the same
    function of its logits row). The processing (bitmask,
    bias, penalties) happens inside a branch that returns only the tokens: a branch
    returning unprocessed logits would copy them (the raw ones stay live for the
    logprobs), 0.27 ms a step for 4 x 49152 on a 2-core Xeon."""
    any_processing = md.any_token_bitmask | md.any_logit_bias | md.any_penalties
    uniforms = row_uniforms(md)  # out here, traced once: the hash would be compiled again in each branch
    token_ids = jax.lax.cond(any_processing, lambda x, h, m, u: _tokens(_processed(x, h, m), m, u, argmax_fn),
                             lambda x, h, m, u: _tokens(x, m, u, argmax_fn), logits, history, md, uniforms)
    lp = jax.lax.cond(md.any_logprobs, scores_fn, _no_logprobs, logits, token_ids)
    beams = jax.lax.cond(md.any_beam, beam_candidates, _no_beam_candidates, logits, md)
    return SamplerOutput(token_ids, *lp, *beams)


def _processed(logits: Float[Array, "S V"], history: Int[Array, "R L"], md: SamplingMetadata) -> Float[Array, "S V"]:
    logits = jax.lax.cond(md.any_token_bitmask, apply_token_bitmask, lambda x, m: x, logits, md)
    logits = jax.lax.cond(md.any_logit_bias, apply_logit_bias, lambda x, m: x, logits, md)
    return jax.lax.cond(md.any_penalties, apply_penalties, lambda x, h, m: x, logits, history, md)


def _tokens(logits: Float[Array, "S V"], md: SamplingMetadata, uniforms: Float[Array, " S"], argmax_fn: ArgmaxFn
            ) -> Int[Array, " S"]:
    greedy = argmax_fn(logits)
    drawn = jax.lax.cond(md.all_greedy, lambda x, m, u: greedy, draw, logits, md, uniforms)
    return jnp.where(md.temperature > 0, drawn, greedy)
