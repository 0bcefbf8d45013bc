"""Speculative decoding's pieces so far (issue 22): the configuration, validated in one
place, and the n-gram proposer against a brute-force oracle."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram_proposer import NgramProposer


def test_config_defaults_follow_vllm():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}').prompt_lookup_max == 5
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
                                 "disable_by_batch_size": 8})
    assert (c.model, c.disable_by_batch_size) == ("/m", 8)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 4}, "method 'eagle' is not supported; choose one of ngram"),
    ({"method": "ngram"}, "are required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown field.*lookahead"),
    ("{not json", "not JSON"),
    ([1, 2], "expected an object"),
])
def test_config_refusals_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, by brute force: longest n first, latest earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(2, 4, 3)
    assert p.propose(np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 7, 8, 2, 3, 4])).tolist() == [7, 8, 2]
    assert p.propose(np.array([5, 6, 5, 6])).tolist() == [5, 6]  # the occurrence near the end: fewer than k
    assert p.propose(np.array([1, 2, 3])).tolist() == []  # no earlier bigram
    assert NgramProposer(1, 1, 2).propose(np.array([7, 1, 7])).tolist() == [1, 7]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 5))
def test_ngram_matches_the_brute_force_definition(tokens, min_n, extra, k):
    got = NgramProposer(min_n, min_n + extra, k).propose(np.array(tokens, np.int32))
    assert got.tolist() == oracle(tokens, min_n, min_n + extra, k)
