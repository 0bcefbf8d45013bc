"""The XLA backend (chunked, tiled, online softmax) against the plain-softmax reference
on ragged batches: decodes, prefill chunks longer than a tile, kv lengths around block
and chunk edges, sliding windows, padding tokens and sequences, shuffled tables."""

import jax
import numpy as np
import pytest

from jaxllm.attention import xla
from pallas_kernels import ragged_paged_attention_reference
from tests.support.attention import make_batch

CASES = {
    "decode_only": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 300)],
    "prefill_only": [(70, 70), (5, 5), (33, 33)],
    "mixed_chunked": [(1, 40), (45, 200), (1, 129), (2, 2), (31, 31), (1, 128), (64, 190)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_matches_reference(case, sliding_window):
    rng = np.random.default_rng(0)
    args, valid = make_batch(rng, CASES[case], block_size=16, num_kv_heads=2, group=3, head_dim=32)
    kw = dict(sm_scale=0.3, sliding_window=sliding_window)
    got = jax.jit(lambda *a: xla.ragged_paged_attention_xla(*a, **kw))(*args)
    want = ragged_paged_attention_reference(*args, **kw)
    np.testing.assert_allclose(np.asarray(got)[:valid], np.asarray(want)[:valid], atol=2e-5, rtol=0)
    assert np.isfinite(np.asarray(got)).all()  # padding rows too


def test_block_size_not_dividing_chunk_and_soft_cap():
    rng = np.random.default_rng(1)
    args, valid = make_batch(rng, [(1, 50), (40, 90), (1, 7)], block_size=48, num_kv_heads=1, group=4, head_dim=16)
    kw = dict(sm_scale=0.5, soft_cap=5.0)
    got = xla.ragged_paged_attention_xla(*args, **kw)
    want = ragged_paged_attention_reference(*args, **kw)
    np.testing.assert_allclose(np.asarray(got)[:valid], np.asarray(want)[:valid], atol=2e-5, rtol=0)
