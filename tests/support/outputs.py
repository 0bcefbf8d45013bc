"""Comparing two engines' outputs (async scheduling, multi-step decode against the
synchronous single-step engine): a workload of prompts and varied sampling, the
outputs it gives, and the comparison."""

import numpy as np

from jaxllm import SamplingParams

# prompts of 5 to 86 tokens: several take chunks over steps of max_num_batched_tokens=32
PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(10)]


def run_outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def _logprob_rows(rows):
    """(token ids and ranks per row, their logprobs) of a request's logprob rows."""
    rows = [row or {} for row in rows or []]
    return ([sorted((t, lp.rank) for t, lp in row.items()) for row in rows],
            [lp.logprob for row in rows for _, lp in sorted(row.items())])


def assert_same_outputs(got, want):
    """Tokens, finish and stop reasons equal; logprobs' tokens and ranks equal, their
    values to float32 rounding."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:3] == w[:3]
        for got_rows, want_rows in ((g[3], w[3]), (g[4], w[4])):
            (g_ids, g_values), (w_ids, w_values) = _logprob_rows(got_rows), _logprob_rows(want_rows)
            assert g_ids == w_ids
            np.testing.assert_allclose(g_values, w_values, rtol=1e-5, atol=1e-5)


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **options)


def varied_params(stop_token: int) -> list[SamplingParams]:
    return [
        greedy(1),
        greedy(2),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5),
        greedy(33, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        greedy(7, logprobs=3, prompt_logprobs=2),
        greedy(24, stop_token_ids=[stop_token]),  # stops while its next step runs
        greedy(24, stop_token_ids=[stop_token], min_tokens=6),
        SamplingParams(max_tokens=16, temperature=1.0, top_k=5, seed=11, logprobs=1),
        greedy(0, prompt_logprobs=1),  # scores its prompt only
        greedy(12),
    ]
