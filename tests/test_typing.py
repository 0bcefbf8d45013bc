"""The jaxtyping shapes on the array functions are checked in the test run (the import
hook in conftest.py): a call that breaks them fails, so the annotations cannot drift."""

import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

from jaxllm.attention.xla import ragged_paged_attention_xla
from jaxllm.models.llama import rms_norm


def test_a_wrong_shape_fails_the_check():
    rms_norm(jnp.ones((3, 8)), jnp.ones(8), 1e-6)
    with pytest.raises(TypeCheckError):
        rms_norm(jnp.ones((3, 8)), jnp.ones(4), 1e-6)


def test_attention_checks_query_start_loc_against_the_sequences():
    """query_start_loc is "S+1": one more entry than kv_lens and block_tables have rows."""
    q = jnp.ones((4, 2, 8))
    cache = jnp.zeros((3, 4, 1, 8))
    kv_lens, tables = jnp.array([2, 2], jnp.int32), jnp.array([[1], [2]], jnp.int32)
    qsl = jnp.array([0, 2, 4], jnp.int32)
    out = ragged_paged_attention_xla(q, cache, cache, kv_lens, tables, qsl, jnp.int32(2), sm_scale=1.0)
    assert np.asarray(out).shape == (4, 2, 8)
    with pytest.raises(TypeCheckError):
        ragged_paged_attention_xla(q, cache, cache, kv_lens, tables, qsl[:2], jnp.int32(2), sm_scale=1.0)
