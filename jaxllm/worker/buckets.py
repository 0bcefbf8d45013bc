"""The step shapes a runner compiles and pads its steps to (buckets).

Every step is padded to a bucket: a token count from a small fixed set, with as many
sequence rows as the token count allows (at most max_num_seqs) and a sample row per
sequence (with speculative decoding also one per token); with multi-step decode, the
decode loop's shapes beside them (jaxllm.worker.decode_loop). Plain Python.
"""

from __future__ import annotations

import dataclasses
import typing


def token_buckets(max_num_batched_tokens: int, smallest: int = 4, speculative: bool = False) -> list[int]:
    """Token counts a step is padded to: 1 (a lone decode), powers of two from
    `smallest` up to the spacing of the large buckets, then multiples of that spacing
    (64, or an eighth of the budget if larger) up to the budget, and the budget itself.
    For 512: 1, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512. Big steps are
    matmul-bound (cost follows the padded count), so they get a fine spacing: a step of
    32 decodes plus one new prompt of ~270 tokens (the common step of serving 32
    clients) pads to 320, not 384; the standard offline workload's padded rows fell
    from 8.7% to 6.2%. Small ones still pay for padding: on SmolLM2 a decode of 1-4
    sequences took 69-74 ms per step padded to 16 tokens and 46-49 ms padded to 4; one
    sequence 14.0-14.4 ms padded to 1 against 16.4-19.3 ms padded to 4 (AMD EPYC Zen 4,
    AVX-512, 2 vCPUs, native build; the AVX2 build not timed). Each bucket is one more
    compilation at start-up, so 2 and 3 pad to 4 -- except with speculative decoding,
    where 2 is a lone decode with one draft token (n-gram lookup's short matches,
    `short_match_tokens` 1): on SmolLM2 a 2-token step costs ~1.1x a 1-token one and a
    4-token step ~1.36x (Intel Xeon, AVX-512, 2 vCPUs, native build; the AVX2 build
    not timed)."""
    budget = max_num_batched_tokens
    step = max(64, budget // 8)
    buckets, b = {1} | ({2} if speculative and budget >= 2 else set()), min(smallest, budget)
    while b < min(step, budget):
        buckets.add(b)
        b *= 2
    buckets.update(range(step, budget, step))
    buckets.add(budget)
    return sorted(buckets)


def seq_bucket(max_num_seqs: int, num_tokens: int) -> int:
    """The sequence rows of a token bucket: as many as it can hold (a step never has
    more sequences than tokens). Padding rows only cost their logits and sampling."""
    return min(max_num_seqs, num_tokens)


class StepShape(typing.NamedTuple):
    """The shape a step is padded to and compiled for: its tokens, sequence rows and
    sample rows, and the decode steps one call runs (1: a single step; more: the
    multi-step decode loop, jaxllm.worker.decode_loop, compiled for that many)."""

    tokens: int
    seqs: int
    sample_rows: int
    decode_steps: int = 1


def step_buckets(token_counts: list[int], max_num_seqs: int, speculative: bool) -> list[StepShape]:
    """The step shapes (tokens, sequences, sample rows): one per token count, sampling
    one row per sequence; with speculative decoding also, where a token count exceeds
    the sequence rows, one sampling every token row (a drafted row samples at each of
    its positions), run only by steps whose drafts need it. Below that every token row
    is a sequence row already, so decodes at small batch need no shape of their own."""
    buckets = []
    for t in token_counts:
        s = seq_bucket(max_num_seqs, t)
        buckets.append(StepShape(t, s, s))
        if speculative and t > s:
            buckets.append(StepShape(t, s, t))
    return buckets


def loop_buckets(token_counts: list[int], max_num_seqs: int, decode_steps: int) -> list[StepShape]:
    """The shapes of the multi-step decode loop: those a step of 1 to max_num_seqs
    decoding sequences (one token each) pads to; none for single steps."""
    if decode_steps <= 1:
        return []
    counts = {smallest_at_least(token_counts, n) for n in range(1, min(max_num_seqs, token_counts[-1]) + 1)}
    return [StepShape(t, seq_bucket(max_num_seqs, t), seq_bucket(max_num_seqs, t), decode_steps)
            for t in sorted(counts)]


def smallest_at_least(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")




@dataclasses.dataclass(frozen=True)
class StepShapes:
    """Every shape a runner compiles: `single` steps and the decode `loops`, over the
    token counts `token_counts`."""

    token_counts: tuple[int, ...]
    single: tuple[StepShape, ...]
    loops: tuple[StepShape, ...]

    @classmethod
    def make(cls, max_num_batched_tokens: int, max_num_seqs: int, speculative: bool = False,
             decode_steps: int = 1) -> StepShapes:
        counts = token_buckets(max_num_batched_tokens, speculative=speculative)
        return cls(tuple(counts), tuple(step_buckets(counts, max_num_seqs, speculative)),
                   tuple(loop_buckets(counts, max_num_seqs, decode_steps)))

    def for_step(self, num_tokens: int, num_seqs: int, num_sample_rows: int | None = None,
                 decode_steps: int = 1) -> StepShape:
        """The smallest shape holding a step (with several decode steps: the loop's,
        compiled for num_scheduler_steps)."""
        t = smallest_at_least(self.token_counts, num_tokens)
        rows = num_sample_rows or num_seqs
        for shape in self.loops if decode_steps > 1 else self.single:
            if shape.tokens == t and num_seqs <= shape.seqs and rows <= shape.sample_rows:
                return shape
        raise ValueError(f"{num_seqs} sequences ({rows} sample rows, {decode_steps} decode steps) exceed every "
                         f"bucket of {t} tokens")
