"""Backends chosen by measurement (jaxllm.worker.autotune): the per-bucket choice from
given times, the stored plan reused, and an engine whose buckets run different
backends giving the tokens a single-backend engine gives."""

import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.engine import core as core_module
from jaxllm.models.params import PackedWeight
from jaxllm.worker import autotune
from jaxllm.worker.autotune import BackendPlan, StepBackends, measured_buckets, plan_backends
from tests.support.llm import make_llm

AUTO = dict(attention_backend="auto", linear_backend="auto")  # make_llm names its backends

BUCKETS = [(4, 4), (8, 8), (16, 8), (32, 8)]


def fake_times(kind, backend, t, s):
    """cpu attention always faster; cpu linear faster below 16 rows, xla from there."""
    if kind == "attention":
        return {"cpu": 1.0, "xla": 2.0}[backend] * t
    return t * (1.0 if backend == "cpu" else 1.5 if t < 16 else 0.5)


def test_each_bucket_gets_the_faster_backend():
    plan = plan_backends(BUCKETS, ["cpu", "xla"], ["cpu", "xla"], fake_times)
    assert [c.attention for c in plan.choices] == ["cpu"] * 4
    assert [c.linear for c in plan.choices] == ["cpu", "cpu", "xla", "xla"]
    assert plan.backends("linear") == ["cpu", "xla"] and plan.source == "measured"
    assert plan.describe("attention") == "cpu (2.00-2.00x xla) [measured]"
    assert plan.describe("linear") == "cpu at T=4-8 (1.50-1.50x xla), xla at T=16-32 (2.00-2.00x cpu) [measured]"
    again = BackendPlan.from_json(plan.to_json())
    assert again.choices == plan.choices and again.seconds == plan.seconds and again.source == "stored"


def test_unmeasured_buckets_follow_the_nearest_smaller_measured_one():
    buckets = [(t, 8) for t in (4, 8, 16, 32, 64, 128)]
    assert measured_buckets(buckets) == [(4, 8), (16, 8), (64, 8), (128, 8)]
    calls = []

    def measure(kind, backend, t, s):
        calls.append((kind, backend, t))
        return 1.0 if (backend == "xla") == (t >= 64) else 2.0

    plan = plan_backends(buckets, ["xla"], ["cpu", "xla"], measure)
    assert {t for k, _, t in calls if k == "linear"} == {4, 16, 64, 128}
    assert {k for k, _, _ in calls} == {"linear", "head"}
    assert [c.linear for c in plan.choices] == ["cpu", "cpu", "cpu", "cpu", "xla", "xla"]
    assert plan.describe("attention") == "xla"
    # the output projection: measured once, at the largest bucket, where the kernel runs some bucket
    assert [(b, t) for k, b, t in calls if k == "head"] == [("cpu", 128)] * 2 + [("xla", 128)] * 2
    assert plan.head == "xla" and plan.describe_head() == "xla (2.00x cpu at 128 rows, 2.00x at 8)"
    assert BackendPlan.from_json(plan.to_json()).head == "xla"
    all_xla = plan_backends(buckets, ["xla"], ["cpu", "xla"], lambda k, b, t, s: 1.0 if b == "xla" else 2.0)
    assert all_xla.head == "cpu" and "head" not in all_xla.seconds  # no bucket runs the kernel: nothing to lay out


@pytest.mark.parametrize("sampling, scoring, head", [
    ((1.0, 1.04), (10.0, 8.0), "xla"),   # XLA ties the sampling rows and wins the scoring ones
    ((1.0, 1.10), (10.0, 8.0), "cpu"),   # XLA loses the sampling rows by more than 5%
    ((1.0, 1.00), (10.0, 10.5), "cpu"),  # XLA slower in all
])
def test_the_output_projection_layout(sampling, scoring, head):
    times = {8: dict(zip(("cpu", "xla"), sampling)), 128: dict(zip(("cpu", "xla"), scoring))}

    def measure(kind, backend, t, s):
        return times[s][backend] if kind == "head" else (1.0 if backend == "cpu" else 2.0)

    buckets = [(t, 8) for t in (4, 8, 16, 32, 64, 128)]
    assert plan_backends(buckets, ["xla"], ["cpu", "xla"], measure).head == head


def test_linear_backends_mix_only_for_a_real_gain():
    """A mixed plan keeps two copies of the weights: only worth it for >= 5% in total."""
    def slight(kind, backend, t, s):  # xla 3% faster at the two largest buckets
        return t * (0.97 if backend == "xla" and t >= 16 else 1.0)

    plan = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], slight)
    assert {c.linear for c in plan.choices} == {"xla"}  # one layout: the faster in total

    def mostly_xla(kind, backend, t, s):  # cpu faster only at the smallest bucket, slightly
        return t * (0.9 if backend == "xla" else 1.0) if t > 4 else (0.99 if backend == "cpu" else 1.0)

    plan = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], mostly_xla)
    assert {c.linear for c in plan.choices} == {"xla"}


def test_a_narrow_win_off_the_default_is_measured_again_on_the_faster_times():
    """A busy moment slowed the kernel's first linear calls at T=16-32, so XLA won them by
    4% and, as one layout, every bucket: short of CONFIRM, every choice is measured once more and made on each call's
    faster time of the two rounds (the kernel, 1.25x). A wide win is not measured again."""
    calls = []

    def busy_then_quiet(kind, backend, t, s):
        calls.append((kind, backend, t))
        slowed = backend == "cpu" and kind == "linear" and t >= 16 and len(calls) <= 8
        return t * (1.0 if backend == "cpu" else 1.25) * (1.3 if slowed else 1.0)

    plan = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], busy_then_quiet)
    assert {c.linear for c in plan.choices} == {"cpu"}
    assert plan.unsure() == ["output projection cpu at 8 rows (1.25x xla)"]  # still under CONFIRM: two rounds at most
    assert plan.rounds == 2 and plan.describe("linear") == "cpu (1.25-1.25x xla) [measured twice]"
    assert len([c for c in calls if c[0] == "linear"]) == 2 * 2 * len(measured_buckets(BUCKETS))
    assert BackendPlan.from_json(plan.to_json()).rounds == 2

    first_round = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], lambda k, b, t, s: t * (1.0 if b == "cpu" else 1.04))
    narrow = dataclasses.replace(first_round, choices=tuple(StepBackends("xla", "xla") for _ in BUCKETS))
    assert first_round.head == "cpu" and first_round.rounds == 2  # the packed head won by 4% only
    assert narrow.unsure() == ["linear xla at T=4 (0.96x cpu)", "linear xla at T=16 (0.96x cpu)",
                               "linear xla at T=32 (0.96x cpu)", "output projection cpu at 8 rows (1.04x xla)"]
    calls.clear()
    wide = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], lambda k, b, t, s: calls.append(b) or (1.0 if b == "xla" else 2))
    assert wide.rounds == 1 and wide.unsure() == [] and {c.linear for c in wide.choices} == {"xla"}
    assert len(calls) == 2 * len(measured_buckets(BUCKETS))


def test_a_busy_moment_at_the_largest_bucket_is_measured_again():
    """A bfloat16 model's plan on the shared AMX Xeon (12-05): the kernel's calls at the
    largest bucket ran in a busy moment, so XLA won it by 1.25x where the kernel is 1.2-1.8x
    faster when quiet. A win under CONFIRM (1.5x) is measured again and chosen on the faster
    times; and the kernel's tiles are described only where the kernel runs the projections."""
    calls = []

    def busy_at_32(kind, backend, t, s):
        calls.append(backend)
        quiet = {"cpu": 1.0, "cpu/float": 3.0, "cpu/amx": 0.5, "xla": 0.8}[backend] * t
        return quiet * (2.0 if backend.startswith("cpu") and t == 32 and len(calls) <= 20 else 1.0)  # round 1

    tiles = ["dot", "float", "amx"]
    plan = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], busy_at_32, bf16_tiles=tiles)
    assert plan.rounds == 2 and {c.linear for c in plan.choices} == {"cpu"}
    assert {c.bf16_tiles for c in plan.choices} == {"amx"}

    def xla_at_32(kind, backend, t, s):  # XLA faster at 32 by 2x: one round, and its bucket's tiles not described
        return {"cpu": 1.0, "cpu/float": 3.0, "cpu/amx": 0.5, "xla": 0.25 if t == 32 else 2.0}[backend] * t

    plan = plan_backends(BUCKETS, ["xla"], ["cpu", "xla"], xla_at_32, bf16_tiles=tiles)
    assert plan.rounds == 1 and [c.linear for c in plan.choices] == ["cpu", "cpu", "cpu", "xla"]
    assert plan.describe("bf16_tiles") == "amx at T=4-16 (2.00-2.00x dot) [measured]"


def test_a_bfloat16_models_attention_rounds_unless_vdpbf16ps_measured_slow():
    """bf16_products: a bfloat16 model's, unless the plan timed the kernel's projections at
    its largest bucket faster with the float tiles than with vdpbf16ps by more than TIE
    and had no AMX tiles to choose (an Intel CPU without AMX, where the attention's
    paired path ran 0.66-0.88x its float path); whichever backend then ran the
    projections (XLA's there: the tiles chosen would say "dot"). A float32 model, never."""
    choices = (StepBackends("cpu", "cpu"), StepBackends("cpu", "xla"))
    def plan(dot, float_, amx=None):
        tiles = {"dot": {8: 1.0, 512: dot}, "float": {8: 2.0, 512: float_}} | ({"amx": {8: 1, 512: amx}} if amx else {})
        return BackendPlan((8, 512), choices, {"bf16_tiles": tiles}, "measured")
    assert plan(dot=100.0, float_=60.0).bf16_products(jnp.bfloat16) is False  # float 1.7x
    assert plan(dot=100.0, float_=99.0).bf16_products(jnp.bfloat16) is True  # within TIE
    assert plan(dot=100.0, float_=120.0).bf16_products(jnp.bfloat16) is True
    assert plan(dot=100.0, float_=60.0, amx=30.0).bf16_products(jnp.bfloat16) is True  # the AMX path
    assert BackendPlan((8,), choices[:1]).bf16_products("bfloat16") is True  # unmeasured
    assert plan(dot=100.0, float_=120.0).bf16_products(jnp.float32) is False


def test_ties_keep_the_first_candidate_and_one_candidate_is_not_measured():
    plan = plan_backends(BUCKETS, ["cpu", "xla"], ["xla"], lambda k, b, t, s: 1.0 if b == "cpu" else 0.99)
    assert {c.attention for c in plan.choices} == {"cpu"}  # 1% faster: within the tie margin
    plan = plan_backends(BUCKETS, ["xla"], ["cpu"], None)
    assert plan.choices == (StepBackends("xla", "cpu"),) * 4 and plan.source == "fixed" and plan.seconds == {}


def test_the_bfloat16_tiles_are_chosen_per_bucket():
    """Where the kernels hold both bfloat16 paths (the same sums): the kernel's
    projections timed with each at the sampled buckets, each bucket taking the faster
    (vdpbf16ps, the first, unless the float tiles beat it by more than TIE); the
    kernel's time in the cpu/xla choice is that of its tiles, timed again beside XLA's
    (the faster of the two: a busy moment between the passes does not hand a bucket to
    XLA), and the output projection is measured with the largest bucket's tiles."""
    buckets = [(t, 8) for t in (1, 2, 4, 8, 16, 32)]  # measured: 1, 4, 16, 32
    calls = []

    def measure(kind, backend, t, s):
        calls.append((kind, backend, t))
        if backend == "cpu/float":  # slower at one row, 1.5x from 4, a tie at 32
            return t * (1.2 if t == 1 else 0.99 if t == 32 else 0.6)
        xla = (0.6 if t in (1, 32) else 0.8) if kind == "linear" else 2.0  # XLA wins by 1.67x at 1 and 32
        return t * (1.0 if backend == "cpu" else xla)

    plan = plan_backends(buckets, ["xla"], ["cpu", "xla"], measure, bf16_tiles=["dot", "float"])
    linear_calls = [(b, t) for k, b, t in calls if k == "linear"]
    assert sorted(b for b, _ in linear_calls) == ["cpu"] * 6 + ["cpu/float"] * 6 + ["xla"] * 4
    # the second pass: each bucket's chosen tiles, then XLA
    assert linear_calls[8:] == [("cpu", 1), ("xla", 1), ("cpu/float", 4), ("xla", 4), ("cpu/float", 16), ("xla", 16),
                                ("cpu", 32), ("xla", 32)]
    first_pass = []

    def busy_at_16(kind, backend, t, s):  # the float tiles' first call at T=16 in a busy moment: 0.9 t
        first_pass.append(backend)
        return measure(kind, backend, t, s) * (1.5 if len(first_pass) <= 8 and (backend, t) == ("cpu/float", 16) else 1)

    assert plan_backends(buckets, ["xla"], ["cpu", "xla"], busy_at_16, bf16_tiles=["dot", "float"]).choices == plan.choices
    assert [c.bf16_tiles for c in plan.choices] == ["dot", "dot", "float", "float", "float", "dot"]
    # the kernel's time, its tiles': 0.6 t against XLA's 0.8 t where it takes the float tiles
    assert [c.linear for c in plan.choices] == ["xla", "xla", "cpu", "cpu", "cpu", "xla"] and plan.rounds == 1
    assert plan.seconds["linear"]["cpu"] == {1: 1.0, 4: 2.4, 16: 9.6, 32: 32.0}
    # the tiles only where the kernel runs the projections
    assert plan.describe("bf16_tiles") == "float at T=4-16 (1.67-1.67x dot) [measured]"
    assert {b for k, b, _ in calls if k == "head"} == {"cpu", "xla"}  # the largest bucket's tiles: dot
    again = BackendPlan.from_json(plan.to_json())
    assert again.choices == plan.choices and again.seconds == plan.seconds
    # the kernel alone (linear_backend="cpu"): the tiles are still measured
    alone = plan_backends(buckets, ["xla"], ["cpu"], measure, bf16_tiles=["dot", "float"])
    assert [c.bf16_tiles for c in alone.choices] == [c.bf16_tiles for c in plan.choices]
    assert alone.source == "measured" and "linear" not in alone.seconds
    assert {c.bf16_tiles for c in plan_backends(buckets, ["xla"], ["cpu"], measure).choices} == {"dot"}


def test_kept_blocks_may_multiply_in_float32_at_the_buckets_where_that_is_faster(monkeypatch):
    """A float32 model's kept blocks that multiply in bfloat16 because activation_quantization
    auto chose it have one more candidate per bucket, last: "none", the same blocks
    multiplied in float32 (`float_dtype`), taken where it beats the others by more
    than TIE (on the AMX Xeon at 1-8 rows). An explicit bfloat16 (the engine passes
    float32_steps only for auto), a bfloat16 model's weights, and blocks that multiply
    in float32 anyway have no such candidate. The step's weights carry it:
    kept blocks in bfloat16 become float32 ones, bit for bit the float path's
    products; plain bfloat16 panels and float32 panels stay as they are."""
    from jaxllm import cpu_kernels
    from jaxllm.models.linear import bf16_tiles, linear, pack_weight
    from jaxllm.models.quant import quantize_weight

    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: True)
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: True)
    assert autotune.bf16_tile_candidates(jnp.bfloat16, ["cpu"], float32_steps=True) == ["dot", "float", "amx", "none"]
    assert autotune.bf16_tile_candidates(jnp.bfloat16, ["cpu"]) == ["dot", "float", "amx"]
    assert autotune.bf16_tile_candidates(jnp.float32, ["cpu"], float32_steps=True) == ["dot"]
    assert autotune.bf16_tile_candidates(jnp.bfloat16, ["xla"], float32_steps=True) == ["dot"]

    buckets = [(t, 8) for t in (1, 4, 8, 16, 32)]  # measured: 1, 8, 32

    def measure(kind, backend, t, s):  # float32 1.5x at 1 row, 1.01x (a tie) at 8, slower at 32
        return {"cpu/none": t * (0.66 if t == 1 else 0.99 if t == 8 else 2.0), "cpu/amx": t * (1.2 if t < 32 else 0.5)
                }.get(backend, t * 1.0)

    plan = plan_backends(buckets, ["cpu"], ["cpu"], measure, bf16_tiles=["dot", "float", "amx", "none"])
    assert [c.bf16_tiles for c in plan.choices] == ["none", "none", "dot", "dot", "amx"]
    assert plan.describe("bf16_tiles").startswith("none at T=1-4 (1.52-1.52x dot), dot at T=8-16")

    rng = np.random.default_rng(3)
    q = quantize_weight(rng.standard_normal((64, 48), np.float32), "q4_1")
    in_bf16, in_float = pack_weight(q.replace(float_dtype="bfloat16")), pack_weight(q)
    panels = pack_weight(rng.standard_normal((64, 48), np.float32).astype(jnp.bfloat16))
    marked = bf16_tiles({"blocks": in_bf16, "float": in_float, "panels": panels}, "none")
    assert marked["blocks"].float_dtype == "float32" and marked["float"] is in_float and marked["panels"] is panels
    x = jnp.asarray(rng.standard_normal((3, 64), np.float32))
    fn = jax.jit(linear)
    np.testing.assert_array_equal(np.asarray(fn(x, marked["blocks"])), np.asarray(fn(x, in_float)))
    assert (np.asarray(fn(x, in_bf16)) != np.asarray(fn(x, in_float))).any()  # bfloat16 inputs: not float32's
    with pytest.raises(ValueError, match="unknown 'fast'; choose one of float, dot, amx, none, int16, bfloat16"):
        bf16_tiles(marked, "fast")

# (26 s: the default run's budget) by default a measured plan's bfloat16 tiles run through an engine in
# tests/models/test_activation_quantization.py, the per-bucket choice above
@pytest.mark.slow
def test_a_bfloat16_engine_runs_the_tiles_its_plan_chose(test_models_dir, tmp_path, monkeypatch):
    """A bfloat16 model whose plan gives the float tiles to its larger buckets: their
    steps' packed weights carry it, the start-up line says it, and the tokens and
    logprobs are those of an engine on the default tiles (the same sums; on a build
    without vdpbf16ps both are the float tiles)."""
    from jaxllm import cpu_kernels

    class FakeTimer:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, kind, backend, t, s):  # the float tiles faster from 4 rows
            return {"cpu": 2.0, "cpu/float": 1.0 if t >= 4 else 3.0}.get(backend, 4.0)

    monkeypatch.setattr(autotune, "StepTimer", FakeTimer)
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: True)
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: False)  # two candidates: dot and float
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, k)]} for k in (4, 13)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    small = dict(dtype="bfloat16", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8)  # 3 buckets
    chosen = make_llm(test_models_dir, compilation_cache_dir=str(tmp_path), **small)
    runner = chosen.llm_engine.core.runner
    assert runner.plan.buckets == (1, 4, 8)  # measured at 1 and 8: 4 takes 1's pick
    assert [c.bf16_tiles for c in runner.plan.choices] == ["dot", "dot", "float"]

    def packed(choice):
        return [w for w in jax.tree.leaves(runner.weights_of(choice), is_leaf=lambda x: isinstance(x, PackedWeight))
                if isinstance(w, PackedWeight)]

    assert all(w.bf16_tiles == "dot" for w in packed(runner.plan.for_bucket(1)))
    assert packed(runner.plan.for_bucket(8)) and all(w.bf16_tiles == "float" for w in packed(runner.plan.for_bucket(8)))
    assert "bfloat16 sums dot at T=1-4 (1.50-1.50x float), float at T=8-8 (2.00-2.00x dot)" in \
        chosen.llm_engine.core.describe()
    got = chosen.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: False)  # one candidate: the default tiles, fixed
    default = make_llm(test_models_dir, **small)
    assert default.llm_engine.core.runner.plan.source == "fixed"
    want = default.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{i: x.logprob for i, x in d.items()} for d in a.outputs[0].logprobs] == \
            [{i: x.logprob for i, x in d.items()} for d in b.outputs[0].logprobs]


def test_the_step_timer_measures_real_steps(test_models_dir):
    """The times are positive and grow with the bucket, for every candidate. (Times on
    a shared machine: a pair out of order is measured again, up to three times; a
    parallel test's busy moment once made a 4-token step's best of many calls 6x a
    256-token one's.)"""
    from jaxllm.loaders import load_model

    model = load_model(test_models_dir / "llama", dtype="float32")
    timer = autotune.StepTimer(model.config, np.float32, block_size=16, max_model_len=128)

    def grows(small, large) -> bool:
        return any(0 < small() < large() for _ in range(3))

    for kind in ("attention", "linear"):
        for backend in ("cpu", "xla"):
            assert grows(lambda: timer(kind, backend, 4, 4), lambda: timer(kind, backend, 256, 8))  # noqa: B023
    for backend in ("cpu", "xla"):  # the output projection: by its rows
        assert grows(lambda: timer("head", backend, 256, 4), lambda: timer("head", backend, 256, 256))  # noqa: B023


def test_the_step_timer_measures_bfloat16_weights_under_float32_activations(test_models_dir):
    """As the runner runs bfloat16 weights on a CPU (jaxllm.platform.activation_dtype):
    the weights it times are bfloat16, the hidden states and caches float32."""
    from jaxllm.loaders import load_model

    model = load_model(test_models_dir / "llama", dtype="float32")
    timer = autotune.StepTimer(model.config, jnp.bfloat16, block_size=16, max_model_len=128,
                               activation_dtype=jnp.float32)
    assert timer("attention", "cpu", 4, 4) > 0 and timer("linear", "xla", 4, 4) > 0 and timer("head", "xla", 0, 8) > 0
    layers, head = timer._weights["xla"]
    assert layers[0][0].dtype == jnp.bfloat16 and head.dtype == jnp.bfloat16
    assert timer._filled((2, 3)).dtype == jnp.float32


@pytest.mark.slow  # 17 s, the default run's budget: an engine runs a measured plan by default (the bfloat16 tiles' test)
def test_an_engine_with_mixed_backends_matches_a_single_backend_one(test_models_dir, tmp_path, monkeypatch):
    """A plan where small buckets use the kernels and large ones XLA: the runner keeps
    both weight layouts, and the tokens and logprobs equal an all-cpu engine's. The
    plan is measured once the weights' loading thread is done, and stored: a second
    engine with the same cache directory measures nothing."""
    measured, loaded, loaded_when_measured = [], [], []
    load_model = core_module.load_model

    def loading(*args, **kwargs):  # the engine's weights, loaded on its thread (slowly: the test can fail)
        model = load_model(*args, **kwargs)
        time.sleep(0.5)
        loaded.append(True)
        return model

    monkeypatch.setattr(core_module, "load_model", loading)

    class FakeTimer:
        def __init__(self, *args, **kwargs):
            loaded_when_measured.append(bool(loaded))

        def __call__(self, kind, backend, t, s):
            measured.append((kind, backend, t))
            return (1.0 if backend == "cpu" else 2.0) if t < 16 else (2.0 if backend == "cpu" else 1.0)

    monkeypatch.setattr(autotune, "StepTimer", FakeTimer)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, k)]} for k in (3, 20, 45)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    few = dict(max_num_seqs=4)  # 7 step shapes, not 8: each engine compiles them
    mixed = make_llm(test_models_dir, compilation_cache_dir=str(tmp_path), **few, **AUTO)
    runner = mixed.llm_engine.core.runner
    assert measured and runner.plan.source == "measured"
    assert loaded_when_measured == [True]  # the weights' loading thread had finished: nothing shared the cores
    assert {c.linear for c in runner.plan.choices} == {"cpu", "xla"}
    assert runner.plan.for_bucket(4) == StepBackends("cpu", "cpu")
    assert runner.plan.for_bucket(32) == StepBackends("xla", "xla")
    assert isinstance(runner.weights["cpu"].layers[0].wqkv, PackedWeight)
    assert not isinstance(runner.weights["xla"].layers[0].wqkv, PackedWeight)
    assert runner.plan.head == "xla" and runner.weights["cpu"].lm_head is None  # tied, the table left unpacked
    assert not isinstance(runner.weights["cpu"].embed, PackedWeight)
    # measured at 1, 8 and 32 (every other bucket and the largest): 16 takes 8's pick
    assert "linear cpu at T=1-16 (2.00-2.00x xla), xla at T=32-32" in mixed.llm_engine.core.describe()
    got = mixed.generate(prompts, params, use_tqdm=False)
    want = make_llm(test_models_dir).generate(prompts, params, use_tqdm=False)  # the tests' all-cpu engine
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            np.testing.assert_allclose([x.logprob for x in la.values()], [x.logprob for x in lb.values()], atol=1e-4)

    measured.clear()
    again = make_llm(test_models_dir, compilation_cache_dir=str(tmp_path), **few, **AUTO)
    assert not measured and again.llm_engine.core.runner.plan.source == "stored"
    assert again.llm_engine.core.runner.plan.choices == runner.plan.choices


@pytest.mark.parametrize("options", [{"attention_backend": "cpu", "linear_backend": "xla"}])
def test_explicit_backends_are_not_measured(test_models_dir, tmp_path, monkeypatch, options):
    monkeypatch.setattr(autotune, "StepTimer", None)  # would fail if called
    llm = make_llm(test_models_dir, compilation_cache_dir=str(tmp_path), max_num_seqs=1, max_num_batched_tokens=4,
                   num_scheduler_steps=1, **options)  # two step shapes to compile: the plan is the point
    plan = llm.llm_engine.core.runner.plan
    assert plan.source == "fixed" and set(plan.choices) == {StepBackends("cpu", "xla")}
    assert "attention cpu; linear xla" in llm.llm_engine.core.describe()


def test_a_quantized_model_is_measured_as_it_is_held(test_models_dir, monkeypatch):
    """On a GPU (one device), `auto` with quantized weights measures XLA's dot against
    the Pallas weight-only matmul (XLA's on a tie); the step timer builds the weights in
    the model's format and each backend's layout: as loaded for xla, marked for the
    Triton kernel, and on a Hopper with bfloat16 activations held K-major for the
    Mosaic GPU one. Elsewhere (and under tensor parallelism) nothing changes."""
    import jaxllm.platform
    from jaxllm.loaders import load_model
    from jaxllm.models.formats import MosaicTiles, PallasTiles, format_of
    from jaxllm.models.linear import linear_candidates
    from jaxllm.models.params import QuantizedWeight

    assert linear_candidates("auto", jnp.float32, quantized=True) == ["cpu"]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert linear_candidates("auto", jnp.bfloat16, quantized=True) == ["xla", "pallas"]
    assert linear_candidates("auto", jnp.bfloat16) == ["xla"]
    assert linear_candidates("auto", jnp.bfloat16, tensor_parallel=True, quantized=True) == ["xla"]
    monkeypatch.undo()

    cfg = load_model(test_models_dir / "llama", dtype="float32", quantization="q4_1").config
    timer = autotune.StepTimer(cfg, jnp.bfloat16, block_size=16, max_model_len=128)
    xla, pallas = timer._linear_weights("xla")[0][0], timer._linear_weights("pallas")[0][0]
    assert all(isinstance(w, QuantizedWeight) and w.group == 32 and not w.kernel for w in xla)
    assert {format_of(w) for w in pallas} == {PallasTiles}
    assert timer("linear", "xla", 4, 4) > 0
    monkeypatch.setattr(jaxllm.platform, "targets_hopper", lambda: True)
    hopper = autotune.StepTimer(cfg, jnp.bfloat16, block_size=16, max_model_len=128)._linear_weights("pallas")[0][0]
    for held, loaded in zip(hopper, xla, strict=True):  # what the kernel serves: N a multiple of 64
        k, n = loaded.shape
        assert (format_of(held), held.shape) == ((MosaicTiles, (n, k)) if n % 64 == 0 else (PallasTiles, (k, n)))
    assert any(format_of(w) is MosaicTiles for w in hopper)


def test_kept_blocks_are_timed_in_the_dtype_they_multiply_in(test_models_dir, monkeypatch):
    """The step timer builds a model's kept blocks as the engine marks them: in bfloat16
    for a bfloat16 model and for a float32 one whose blocks multiply bfloat16 activations
    (`blocks_in_bf16`), in float32 otherwise (it once timed every bfloat16 model's blocks
    as float32 ones, so each tile choice measured the same path); and the kernel's tiles
    offered: vdpbf16ps and the float tiles with AVX512_BF16, AMX's too where it is."""
    from jaxllm import cpu_kernels
    from jaxllm.loaders import load_model

    cfg = load_model(test_models_dir / "llama", dtype="float32", quantization="q4_1").config

    def kept(dtype, **options):
        layers = autotune.StepTimer(cfg, dtype, block_size=16, max_model_len=128, **options)._linear_weights("cpu")[0]
        return {(w.float_dtype, w.activations) for w in layers[0]}

    assert kept(jnp.bfloat16) == {("bfloat16", "float")}
    assert kept(jnp.float32, blocks_in_bf16=True) == {("bfloat16", "float")}
    assert kept(jnp.float32) == {("float32", "float")}
    assert kept(jnp.float32, blocks_in_int16=True) == {("float32", "int16")}
    # the int16 blocks timed as they are and in bfloat16 from the same arrays (BF16_STEP)
    timer = autotune.StepTimer(cfg, jnp.float32, block_size=16, max_model_len=128, blocks_in_int16=True)
    assert timer("linear", "cpu/int16", 32, 4) > 0 and timer("linear", "cpu/bfloat16", 32, 4) > 0
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: True)
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: True)
    assert autotune.bf16_tile_candidates(jnp.bfloat16, ["cpu", "xla"]) == ["dot", "float", "amx"]
    assert autotune.bf16_tile_candidates(jnp.float32, ["cpu"]) == ["dot"]
    assert autotune.bf16_tile_candidates(jnp.bfloat16, ["xla"]) == ["dot"]
    monkeypatch.setattr(cpu_kernels, "has_amx", lambda: False)
    assert autotune.bf16_tile_candidates(jnp.bfloat16, ["cpu"]) == ["dot", "float"]
    assert autotune.bf16_tile_candidates(jnp.float32, ["cpu"], int16_steps=True) == ["int16", "bfloat16"]
    assert autotune.bf16_tile_candidates(jnp.float32, ["xla"], int16_steps=True) == ["int16"]
    monkeypatch.setattr(cpu_kernels, "has_bf16_dot", lambda: False)
    assert autotune.bf16_tile_candidates(jnp.float32, ["cpu"], int16_steps=True) == ["int16"]


def _clock_readings(*busy_spans):
    """CpuClock.now's readings for spans of 10 s in turn, other processes keeping the given
    cores busy in each (this process one core throughout)."""
    readings, machine, wall = [], 100.0, 0.0
    for others in busy_spans:
        readings.append(autotune.CpuClock(wall, machine, wall))
        wall, machine = wall + 10, machine + 10 + 10 * others
        readings.append(autotune.CpuClock(wall, machine, wall))
    return iter(readings)


@pytest.mark.parametrize("busy_now", [0.0, 0.8])
def test_a_plan_measured_beside_other_work_is_measured_again_once_the_cpu_is_quiet(
        test_models_dir, tmp_path, monkeypatch, caplog, busy_now):
    """Other processes busy while the backends are measured (a server still exiting beside
    a benchmark's next one made XLA look 1.6-1.9x faster at 256-448 rows, and each later
    start reused that plan): the plan is stored marked so; a later start that finds other
    processes still busy uses it (a test suite's parallel workers: no re-measuring at each
    start), one that finds the CPU quiet measures again and stores a plan no later start
    second-guesses."""
    from jaxllm.loaders import load_model

    measured = []

    class FakeTimer:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, kind, backend, t, s):
            measured.append((kind, backend, t))
            return 1.0 if backend == "cpu" else 2.0

    # measured beside 0.8 busy cores; at the next start busy_now (the sample), then measured quietly
    readings = _clock_readings(0.8, busy_now, 0.0)
    monkeypatch.setattr(autotune, "StepTimer", FakeTimer)
    monkeypatch.setattr(autotune.CpuClock, "now", classmethod(lambda cls: next(readings)))
    monkeypatch.setattr(autotune.time, "sleep", lambda s: None)
    cfg = load_model(test_models_dir / "llama", dtype="float32").config

    def plan():
        return autotune.backend_plan(cfg, jnp.float32, BUCKETS, ["cpu", "xla"], ["cpu", "xla"], block_size=16,
                                     max_model_len=128, store_dir=tmp_path)

    caplog.set_level("INFO", logger=autotune.__name__)
    first = plan()
    assert first.source == "measured" and first.others_busy == 0.8 and {c.linear for c in first.choices} == {"cpu"}
    assert "kept 0.80 cores busy while the backends were measured" in caplog.text
    assert first.describe("linear").endswith("[measured while others kept 0.80 cores busy]")
    runs = len(measured)
    second = plan()
    assert second.choices == first.choices
    if busy_now:
        assert (second.source, second.others_busy, len(measured)) == ("stored", 0.8, runs)
        assert "they keep 0.80 busy now: using it" in caplog.text
        return
    assert (second.source, second.others_busy, len(measured)) == ("measured", 0.0, 2 * runs)
    assert "the CPU is quiet now: measuring again" in caplog.text
    third = plan()  # a quiet plan: used without sampling the CPU (no readings are left)
    assert (third.source, third.others_busy, len(measured)) == ("stored", 0.0, 2 * runs)
    assert third.describe("linear").endswith("[stored]")


def test_the_cpu_clock_counts_other_processes_cores():
    start = autotune.CpuClock(0.0, 50.0, 5.0)
    assert autotune.CpuClock(4.0, 58.0, 11.0).others_busy_since(start) == pytest.approx(0.5)  # 8 busy, 6 ours
    assert autotune.CpuClock(4.0, 56.0, 11.0).others_busy_since(start) == 0.0  # never below none
    assert autotune.CpuClock(4.0, None, 11.0).others_busy_since(start) == 0.0  # an OS that does not say
    now = autotune.CpuClock.now()
    assert now.own >= 0 and now.machine is not None and now.machine >= 0


STAT = """cpu  100 0 50 1000 10 0 5 0 0 0
cpu0 60 0 30 400 5 0 5 0 0 0
cpu1 40 0 20 600 5 0 0 0 0 0
intr 12345
"""


def test_busy_ticks_are_those_of_the_cores_asked_for():
    """/proc/stat's busy ticks (all but idle and iowait): every core's from its first line,
    or the named cores' `cpuN` lines alone; on this machine the cores' lines sum to the
    first line's (a process pinned to other cores is not counted as a neighbour)."""
    from jaxllm.platform import busy_ticks

    assert (busy_ticks(STAT), busy_ticks(STAT, {0}), busy_ticks(STAT, {1}), busy_ticks(STAT, {0, 1})) == (155, 95, 60, 155)
    assert busy_ticks(STAT, set()) == 0
    stat = Path("/proc/stat").read_text() if Path("/proc/stat").exists() else pytest.skip("no /proc/stat")
    cores = {int(line.split()[0][3:]) for line in stat.splitlines() if line[:3] == "cpu" and line[3].isdigit()}
    assert busy_ticks(stat, cores) == pytest.approx(busy_ticks(stat), rel=1e-3, abs=len(cores))


def test_stolen_ticks_are_the_eighth_column():
    """/proc/stat's steal (the hypervisor's share of a guest's cores, which the benchmarks
    record per run): every core's, or the named cores'; a line without the column, none."""
    from jaxllm.platform import busy_ticks, steal_ticks

    stat = "cpu  100 0 50 1000 10 0 5 40 0 0\ncpu0 60 0 30 400 5 0 5 30 0 0\ncpu1 40 0 20 600 5 0 0 10 0 0\n"
    assert (steal_ticks(stat), steal_ticks(stat, {0}), steal_ticks(stat, {1})) == (40, 30, 10)
    assert busy_ticks(stat) == 195  # stolen time is not this machine's idle time
    assert steal_ticks("cpu  100 0 50 1000 10 0 5\n") == 0


def test_the_cpu_clock_reads_the_cores_this_process_may_run_on(monkeypatch):
    asked = []
    monkeypatch.setattr(autotune, "usable_cpus", lambda: frozenset({0}))
    monkeypatch.setattr(autotune, "busy_cpu_seconds", lambda cpus=None: asked.append(cpus) or 7.0)
    assert autotune.CpuClock.now().machine == 7.0 and asked == [frozenset({0})]


def test_starts_measuring_the_same_plan_together_measure_it_once(test_models_dir, tmp_path, monkeypatch, caplog):
    """Two engines of the same model and buckets measuring at once (data-parallel replicas on
    one machine; servers started together): the second waits for the first's plan, saying
    so, and takes it instead of measuring beside it."""
    import threading

    from jaxllm.loaders import load_model

    measuring, waiting, measured = threading.Event(), threading.Event(), []

    class SlowTimer:  # the first start's measurement lasts until the second waits for it
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, kind, backend, t, s):
            measuring.set()
            assert waiting.wait(60)
            measured.append((kind, backend, t))
            return 1.0 if backend == "cpu" else 2.0

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for its plan" in record.getMessage():
                waiting.set()

    monkeypatch.setattr(autotune, "StepTimer", SlowTimer)
    cfg = load_model(test_models_dir / "llama", dtype="float32").config
    caplog.set_level("INFO", logger=autotune.__name__)
    handler = Waiting()
    autotune.logger.addHandler(handler)
    plans = {}

    def plan(name):
        plans[name] = autotune.backend_plan(cfg, jnp.float32, BUCKETS, ["cpu", "xla"], ["cpu", "xla"], block_size=16,
                                            max_model_len=128, store_dir=tmp_path)

    first = threading.Thread(target=plan, args=("first",))
    first.start()
    try:
        assert measuring.wait(60)
        plan("second")  # flock: each open of the lock file is its own holder, in one process as in two
    finally:
        waiting.set()
        first.join()
        autotune.logger.removeHandler(handler)
    runs = len(measured)
    assert plans["first"].source == "measured" and plans["second"].source == "stored"
    assert plans["second"].choices == plans["first"].choices
    assert "another process is measuring the backends of this model and these buckets" in caplog.text
    plan("third")
    assert len(measured) == runs and plans["third"].source == "stored"
