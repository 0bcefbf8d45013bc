"""The on-device sampler against numpy references on a tiny vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.sampler import sample

V = 8


def metadata(s, **rows):
    """SamplingMetadata for s rows; per-row values given as lists override defaults."""
    d = dict(temperature=[1.0] * s, top_k=[0] * s, top_p=[1.0] * s, min_p=[0.0] * s, presence_penalty=[0.0] * s,
             frequency_penalty=[0.0] * s, repetition_penalty=[1.0] * s, seeds=[[0, 0]] * s, output_index=[0] * s,
             bias_token_ids=[[0]] * s, bias_values=[[0.0]] * s, history_rows=list(range(s)),
             num_prompt_tokens=[0] * s, num_known_tokens=[0] * s, token_bitmask=[[-1]] * s)
    d.update(rows)
    arr = {k: np.asarray(v, np.uint32 if k == "seeds" else None) for k, v in d.items()}
    for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "bias_values"):
        arr[k] = arr[k].astype(np.float32)
    for k in ("top_k", "output_index", "bias_token_ids", "history_rows", "num_prompt_tokens", "num_known_tokens",
              "token_bitmask"):
        arr[k] = arr[k].astype(np.int32)
    t = arr["temperature"]
    return SamplingMetadata(
        **arr,
        all_greedy=np.bool_((t == 0).all()),
        any_top_k_top_p=np.bool_(((arr["top_k"] > 0) | (arr["top_p"] < 1)).any()),
        any_min_p=np.bool_((arr["min_p"] > 0).any()),
        any_penalties=np.bool_(((arr["presence_penalty"] != 0) | (arr["frequency_penalty"] != 0)
                                | (arr["repetition_penalty"] != 1)).any()),
        any_logprobs=np.bool_(True),
        any_token_bitmask=np.bool_((arr["token_bitmask"] != -1).any()),
    )


_sample = jax.jit(sample)
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


def draws(n, logits=LOGITS, **row):
    """n samples of one row: n rows with the same params and consecutive output indices."""
    md = metadata(n, output_index=list(range(n)), seeds=[[42, 0]] * n, **{k: [v] * n for k, v in row.items()})
    history = np.zeros((n, 1), np.int32)
    out = _sample(jnp.asarray(np.tile(logits, (n, 1))), history, md)
    return np.asarray(out.token_ids)


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_matches_softmax(temperature):
    n = 4000
    counts = np.bincount(draws(n, temperature=temperature), minlength=V)
    expected = softmax(LOGITS / temperature) * n
    keep = expected >= 5  # chi-square needs expected counts >= 5; pool the tail
    obs, exp = counts[keep], expected[keep]
    if (~keep).any():
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, expected[~keep].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_filters_never_sample_outside_their_sets():
    p = softmax(LOGITS)
    assert set(draws(1000, top_k=3)) == {0, 1, 2}
    # top_p=0.6: smallest set reaching 0.6 mass is the first k tokens with cumsum >= 0.6
    k = int(np.searchsorted(np.cumsum(p), 0.6)) + 1
    assert set(draws(1000, top_p=0.6)) == set(range(k))
    # min_p=0.3: tokens with p >= 0.3 * max(p)
    allowed = set(np.flatnonzero(p >= 0.3 * p.max()))
    assert set(draws(1000, min_p=0.3)) == allowed
    # top-k then top-p over the renormalized top-k
    pk = softmax(LOGITS[:4])
    kk = int(np.searchsorted(np.cumsum(pk), 0.8)) + 1
    assert set(draws(1000, top_k=4, top_p=0.8)) == set(range(kk))


def test_filtered_distribution_is_renormalized():
    n = 4000
    counts = np.bincount(draws(n, top_k=3), minlength=V)[:3]
    assert stats.chisquare(counts, softmax(LOGITS[:3]) * n).pvalue > 1e-3


def test_seeds_and_output_index_decide_the_draw():
    a = draws(50)
    assert (a == draws(50)).all()
    md = metadata(2, seeds=[[42, 0], [43, 0]], output_index=[0, 0])
    many = [np.asarray(_sample(jnp.asarray(np.tile(LOGITS, (2, 1))), np.zeros((2, 1), np.int32),
                               md.replace(output_index=np.array([i, i], np.int32))).token_ids) for i in range(40)]
    assert any(x[0] != x[1] for x in many)  # different seeds, different draws


def numpy_reference(logits, history, prompt_len, known, presence, frequency, repetition, bias):
    out = logits.copy()
    for token, value in bias.items():
        out[token] += value
    tokens = history[:known]
    prompt, output = tokens[:prompt_len], tokens[prompt_len:]
    counts = np.bincount(output, minlength=len(out)).astype(np.float32)
    seen = (counts > 0) | np.isin(np.arange(len(out)), prompt)
    out = np.where(seen, np.where(out > 0, out / repetition, out * repetition), out)
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_and_logit_bias_match_numpy():
    rng = np.random.default_rng(0)
    s, length = 3, 12
    logits = rng.standard_normal((s, V)).astype(np.float32) * 2
    history = rng.integers(0, V, (s + 1, length)).astype(np.int32)
    params = dict(presence_penalty=[0.5, 0.0, -0.3], frequency_penalty=[0.2, 0.7, 0.0],
                  repetition_penalty=[1.3, 1.0, 0.8], num_prompt_tokens=[4, 6, 0], num_known_tokens=[10, 12, 7],
                  bias_token_ids=[[1, 5], [2, 2], [0, 0]], bias_values=[[3.0, -2.0], [1.0, 0.5], [0.0, 0.0]])
    md = metadata(s, temperature=[0.0] * s, **params)
    out = _sample(jnp.asarray(logits), history, md)
    refs = []
    for i in range(s):
        bias = {}
        for t, v in zip(params["bias_token_ids"][i], params["bias_values"][i]):
            bias[t] = bias.get(t, 0.0) + v
        refs.append(numpy_reference(logits[i], history[i], params["num_prompt_tokens"][i],
                                    params["num_known_tokens"][i], params["presence_penalty"][i],
                                    params["frequency_penalty"][i], params["repetition_penalty"][i], bias))
    for i, ref in enumerate(refs):
        assert int(out.token_ids[i]) == int(np.argmax(ref))
    # the processed logits themselves: compare through a greedy pick on each shifted token
    from jaxllm.sample.sampler import apply_logit_bias, apply_penalties
    got = np.asarray(apply_penalties(apply_logit_bias(jnp.asarray(logits), md), jnp.asarray(history), md))
    for i, ref in enumerate(refs):
        np.testing.assert_allclose(got[i], ref, rtol=1e-6, atol=1e-6)


def test_logprobs_of_the_raw_distribution():
    md = metadata(1, temperature=[0.0], bias_token_ids=[[7]], bias_values=[[50.0]])
    out = _sample(jnp.asarray(LOGITS[None]), np.zeros((1, 1), np.int32), md)
    lp = LOGITS - np.log(np.exp(LOGITS).sum())
    assert int(out.token_ids[0]) == 7  # the bias decides the sample...
    np.testing.assert_allclose(float(out.sampled_logprob[0]), lp[7], rtol=1e-5)  # ...not the logprob
    assert int(out.sampled_rank[0]) == 8
    np.testing.assert_array_equal(np.asarray(out.top_token_ids[0, :V]), np.arange(V))


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """[S, V] bools -> [S, ceil(V / 32)] int32 words (bit t % 32 of word t // 32)."""
    s, v = allowed.shape
    bits = np.zeros((s, -(-v // 32) * 32), np.uint64)
    bits[:, :v] = allowed
    words = (bits.reshape(s, -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def test_token_bitmask_restricts_constrained_rows_only():
    """Rows 0-3 constrained (greedy, sampled, one token allowed, a token past the first
    word), rows 4-5 unconstrained: the constrained ones stay in their sets, the others
    sample as without a mask, and logprobs stay those of the raw distribution."""
    v, s = 70, 6
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    allowed = np.ones((s, v), bool)
    allowed[0] = rng.random(v) < 0.3
    allowed[1] = rng.random(v) < 0.3
    allowed[2] = False
    allowed[2, 5] = True
    allowed[3] = False
    allowed[3, [40, 69]] = True
    temperature = [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    common = dict(temperature=temperature, seeds=[[7, 0]] * s, output_index=list(range(s)))
    md = metadata(s, token_bitmask=pack_bitmask(allowed), **common)
    history = np.zeros((s, 1), np.int32)
    out = _sample(jnp.asarray(logits), history, md)
    tokens = np.asarray(out.token_ids)
    assert all(allowed[i, tokens[i]] for i in range(s))
    assert tokens[0] == np.flatnonzero(allowed[0])[np.argmax(logits[0, allowed[0]])]
    assert tokens[2] == 5 and tokens[3] == [40, 69][int(np.argmax(logits[3, [40, 69]]))]
    free = _sample(jnp.asarray(logits), history, metadata(s, token_bitmask=pack_bitmask(np.ones((s, v), bool)),
                                                            **common))
    np.testing.assert_array_equal(tokens[4:], np.asarray(free.token_ids)[4:])
    lp = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    np.testing.assert_allclose(float(out.sampled_logprob[0]), lp[tokens[0]], rtol=1e-5)
    many = draws(400, logits=logits[1], temperature=1.0, token_bitmask=pack_bitmask(allowed[1:2])[0])
    assert set(many.tolist()) <= set(np.flatnonzero(allowed[1]).tolist()) and len(set(many.tolist())) > 3


@pytest.mark.parametrize("s,v", [(1, 1), (3, 7), (4, 16), (5, 33), (64, 4099), (2, 49152)])
def test_argmax_kernel_matches_jnp_argmax(s, v):
    """The cpu kernels' greedy pick: the first index of the maximum, NaN counting as the
    maximum, in rows of any length (vector tails, rows shorter than a vector)."""
    from jaxllm.sample.sampler import argmax_cpu

    rng = np.random.default_rng(v)
    x = rng.standard_normal((s, v)).astype(np.float32)
    if v > 3:
        x[0, 2] = x[0, v - 1] = x[0].max() + 1  # a tie: the first index wins
    if s > 1 and v > 20:
        x[1, 17] = x[1, v - 2] = np.nan  # the first NaN
    if s > 2:
        x[2] = -np.inf  # all equal: index 0
    if s > 3:
        x[3, v - 1] = np.inf  # the maximum in the tail
    if s > 4 and v > 32:
        x[4, 15] = x[4, 16] = x[4].max() + 1  # a tie across lanes: lane 15 holds the lesser index
    ref = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax_cpu)(jnp.asarray(x))), ref)


@pytest.mark.parametrize("s,v", [(1, 20), (3, 21), (5, 33), (64, 4099), (6, 49152)])
def test_token_scores_kernel_matches_the_jnp_scores(s, v):
    """The prompt-logprob kernel against compute_logprobs (log_softmax at the target, its
    rank, top_k): vector tails, ties in the top k (the lesser index first, as top_k),
    ties with the target (rank counts only greater values), skipped rows."""
    from jaxllm.sample.sampler import compute_logprobs, token_scores_cpu

    rng = np.random.default_rng(s + v)
    x = (4 * rng.standard_normal((s, v))).astype(np.float32)
    targets = rng.integers(0, v, s).astype(np.int32)
    x[0, 3] = x[0, v - 1] = x[0].max() + 1  # a tie at the top: index 3 first
    x[0, 5] = x[0, targets[0]] = x[0, targets[0]] + 0.0  # a value tied with the target
    if s > 1:
        x[1, :] = 0.0  # all equal: top_k is 0, 1, 2, ...; rank 1
    if s > 2:
        targets[2] = -1  # not scored
    if s > 4:
        x[4, 16:20] = x[4].max() + 2  # ties across vector lanes
    got = [np.asarray(a) for a in jax.jit(token_scores_cpu)(jnp.asarray(x), jnp.asarray(targets))]
    want = [np.asarray(a) for a in jax.jit(compute_logprobs)(jnp.asarray(x), jnp.asarray(targets))]
    scored = targets >= 0
    np.testing.assert_allclose(got[0][scored], want[0][scored], atol=2e-5)  # logprob of the target
    np.testing.assert_array_equal(got[1][scored], want[1][scored])  # rank
    np.testing.assert_array_equal(got[2][scored], want[2][scored])  # top ids, in order
    np.testing.assert_allclose(got[3][scored], want[3][scored], atol=2e-5)
    if s > 2:
        assert (got[0][2], got[1][2]) == (0.0, 0) and not got[2][2].any()
