"""scripts/profile_serving.py: the profiler's thunks split by the model's named scopes
(read from a compiled function's HLO metadata and JAX's own perfetto trace), and the
engine options parsed by the server's parser."""

import time

import jax
import jax.numpy as jnp
import profile_serving


def _scoped(x, w):
    with jax.named_scope("layer0"):
        with jax.named_scope("mlp"):
            y = jax.lax.optimization_barrier(jnp.tanh(x @ w))  # not fused with what follows
        with jax.named_scope("attention"):
            y = jax.nn.softmax(y @ w.T, axis=-1)
    return y.sum()


def test_thunks_are_split_by_scope(tmp_path):
    """Each thunk the profiler records maps to the scope it was traced under (a fusion
    to its root's: XLA may fuse across scopes, hence the barrier here) and is an
    instruction of the module."""
    x, w = jnp.ones((256, 256)), jnp.ones((256, 256)) / 256
    fn = jax.jit(_scoped)
    compiled = fn.lower(x, w).compile()
    scopes = profile_serving.op_scopes(compiled.as_text())
    assert {"mlp", "attention"} <= set(scopes.values())
    compiled(x, w).block_until_ready()
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    with jax.profiler.TraceAnnotation(profile_serving.CALL):
        compiled(x, w).block_until_ready()
    jax.profiler.stop_trace()
    (per_op,) = profile_serving.thunk_seconds_per_call(str(tmp_path))
    assert per_op and set(per_op) <= set(scopes)
    assert {scopes[op] for op in per_op} >= {"mlp", "attention"}


def test_thunks_are_split_by_call(tmp_path):
    """Each annotated call gets the thunks that ran inside it: two calls, each with the
    scopes' ops, none outside a call counted, each call's seconds within its window."""
    x, w = jnp.ones((256, 256)), jnp.ones((256, 256)) / 256
    compiled = jax.jit(_scoped).lower(x, w).compile()
    scopes = profile_serving.op_scopes(compiled.as_text())
    compiled(x, w).block_until_ready()
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    compiled(x, w).block_until_ready()  # outside any call: not counted
    walls = []
    for _ in range(2):
        with jax.profiler.TraceAnnotation(profile_serving.CALL):
            start = time.perf_counter()
            compiled(x, w).block_until_ready()
            walls.append(time.perf_counter() - start)
    jax.profiler.stop_trace()
    calls = profile_serving.thunk_seconds_per_call(str(tmp_path))
    assert len(calls) == 2
    for per_op, wall in zip(calls, walls):
        assert {scopes[op] for op in per_op} >= {"mlp", "attention"}
        assert 0 < sum(per_op.values()) <= wall * 1.05
    # the unannotated call's thunks (the same ops) start outside both windows: in no call
    events = profile_serving._trace_events(str(tmp_path))
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == profile_serving.CALL]
    outside = {op for op, start, _ in profile_serving._thunks(events) if not any(a <= start <= b for a, b in windows)}
    assert outside and outside <= set(calls[0]) | set(calls[1])


def test_engine_args_parse_as_the_server_does():
    assert profile_serving.engine_overrides("--kv-cache-dtype bfloat16 --max-num-seqs 8") == {
        "kv_cache_dtype": "bfloat16", "max_num_seqs": 8}
    assert profile_serving.engine_overrides("") == {}
