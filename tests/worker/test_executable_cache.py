"""The executable store's bound: the least recently used entries go first."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.worker import executable_cache
from jaxllm.worker.executable_cache import ExecutableStore


def test_storing_deletes_the_least_recently_used_beyond_max_entries(tmp_path, monkeypatch):
    """A load counts as a use (it refreshes the entry's time); storing past MAX_ENTRIES
    deletes the entry used longest ago, and what stays still loads and runs."""
    monkeypatch.setattr(executable_cache, "MAX_ENTRIES", 2)
    store = ExecutableStore(tmp_path, "test")
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()
    for i, name in enumerate(("a", "b")):
        store.save(name, compiled)
        os.utime(store._path(name), (1000 + i, 1000 + i))  # a used before b
    assert store.load("a") is not None  # a is now the more recent
    store.save("c", compiled)
    assert sorted(p.name.split("-")[-1] for p in tmp_path.glob("*.bin")) == ["a.bin", "c.bin"]
    np.testing.assert_array_equal(store.load("a")(jnp.ones(2)), [2, 2])
    assert store.load("b") is None
