"""Checks that need several JAX devices, run in a subprocess of their own with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (it must be set before jax is
imported, so not in the pytest process): `run(check, *args, devices=N)` runs
`check(*args)` from this module there and fails with its output if it fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaxllm.engine.core_client import host_device_flags
from tests.support.llm import LAZY

ROOT = Path(__file__).resolve().parents[2]


def run(check: str, *args: str, devices: int = 8, timeout: float = 600) -> str:
    return run_check("tests.support.multidevice", check, args, {"XLA_FLAGS": host_device_flags(devices)}, timeout)


def run_check(module: str, check: str, args, env: dict[str, str | None], timeout: float) -> str:
    """`module.check(*args)` in a new process on the CPU platform, with `env` over this
    process's environment (None: unset); its output (AssertionError with it if it fails)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **env)
    env = {k: v for k, v in env.items() if v is not None}
    code = f"import {module} as m; m.{check}(*{list(args)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{check}{tuple(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout


def assert_same_greedy(one, many) -> None:
    """Two runs' RequestOutputs: the same tokens, each logprob within 1e-4."""
    for a, b in zip(one, many, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].token_ids, b.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 1e-4


PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is Paris; one two"


def shared_prefix_batch():
    """Five prompts of random token ids sharing a 40-token prefix, 24 greedy tokens each
    with top-2 logprobs: prefix caching and chunked prefill in one batch."""
    import numpy as np

    from jaxllm import SamplingParams

    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(3, 500, 40)]
    prompts = [{"prompt_token_ids": shared + [int(t) for t in rng.integers(3, 500, k)]} for k in (3, 20, 45, 7, 60)]
    return prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)


def pallas_engine_workload():
    """tests/kernels/test_pallas_engine.py's six prompts (3-60 random token ids) and their greedy
    sampling params (2-12 tokens)."""
    import numpy as np

    from jaxllm import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 500, int(rng.integers(3, 60)))] for _ in range(6)]
    return prompts, [SamplingParams(temperature=0, max_tokens=int(rng.integers(2, 12)), ignore_eos=True)
                     for _ in prompts]


def tp_logits_match(folder: str, size: str, attention: str = "xla", quantization: str | None = None,
                    kv_cache_dtype: str = "auto") -> None:
    """Tensor-parallel logits equal one device's within 1e-5 of the logits' scale (the
    all-reduces sum in another order; the test models' logits reach ~20): one prefill,
    chunked prefill, token by token, a mixed ragged step; with a `kv_cache_dtype` cache
    (an int8 cache's scales sharded by KV head with their rows)."""
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxllm.attention.backends import get_attention_fn
    from jaxllm.loaders import load_model
    from jaxllm.models.parallel import shard_config
    from tests.support.paged_driver import PagedDriver

    model = load_model(folder, dtype="float32", quantization=quantization or None)  # "": as stored
    tok = model.tokenizer
    ids = tok.encode(PROMPT)
    fn = get_attention_fn(attention)
    one = PagedDriver(model.config, model.params, block_size=8, attention_fn=fn, kv_cache_dtype=kv_cache_dtype)
    tp = PagedDriver(model.config, model.params, block_size=8, attention_fn=fn, tensor_parallel_size=int(size),
                     kv_cache_dtype=kv_cache_dtype)
    assert tp.caches[0].format.name == one.caches[0].format.name == {"auto": "float32", "fp8-scaled": "fp8_e4m3"}.get(
        kv_cache_dtype, kv_cache_dtype)
    if kv_cache_dtype == "int8":
        assert tp.caches[0].k_scale.sharding.spec == P(None, None, "model")
    if kv_cache_dtype == "fp8-scaled":  # calculated by each shard for its own KV heads: the same scales
        assert tp.caches[0].k_layer_scale.sharding.spec == P("model")
    wqkv = tp.params.layers[0].wqkv
    held = model.config.quantization  # as asked, or as a GGUF / GPTQ checkpoint stores it
    if held == "int8":  # the values as the weight, the scales with their columns
        assert wqkv.q.sharding.spec == P(None, "model") and wqkv.scale.sharding.spec == P("model")
        wqkv = wqkv.q
    elif held is not None:  # [K / group, N] scales (and mins) split like the values
        w_down = tp.params.layers[0].w_down  # row-parallel: by input groups
        for grouped in (wqkv.scale, wqkv.mins) if wqkv.mins is not None else (wqkv.scale,):
            assert grouped.sharding.spec == P(None, "model")
        for grouped in (w_down.scale, w_down.mins) if w_down.mins is not None else (w_down.scale,):
            assert grouped.sharding.spec == P("model", None)
        wqkv = wqkv.q
    assert wqkv.sharding.spec == P(None, "model")
    local = shard_config(model.config, int(size))
    assert tp.caches[0].k.addressable_shards[0].data.shape[2] == local.num_kv_heads
    # fp8's steps (1/16 of a value) turn the all-reduces' last-bit differences into a few
    # elements rounded one step apart: 1% of the logits' scale; its scales, each shard
    # calculating its own KV heads', equal one device's
    tolerance = 1e-2 if kv_cache_dtype == "fp8-scaled" else 1e-5
    for chunks in ([len(ids)], [5, 7, 1, len(ids) - 13], [1] * len(ids)):
        want = one.prompt_logits(ids, chunks)
        got = tp.prompt_logits(ids, chunks)
        np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max(), rtol=0, err_msg=f"chunks={chunks}")
        if kv_cache_dtype == "fp8-scaled":
            for c_tp, c_one in zip(tp.caches, one.caches):
                for name in ("k_layer_scale", "v_layer_scale"):
                    np.testing.assert_allclose(np.asarray(getattr(c_tp, name)), np.asarray(getattr(c_one, name)),
                                               rtol=1e-6)
    a, b = ids, tok.encode("Hello world! How are you today?")
    outs = []
    for driver in (one, tp):
        sa, sb = driver.new_sequence(a), driver.new_sequence(b)
        (a1,) = driver.step([(sa, len(a) - 1)], all_logits=True)
        a2, b1 = driver.step([(sa, 1), (sb, len(b))], all_logits=True)
        outs.append(np.concatenate([a1, a2, b1]))
    np.testing.assert_allclose(outs[1], outs[0], atol=tolerance * np.abs(outs[0]).max(), rtol=0)
    print("ok", folder, size, attention)


def tp_engine_matches(folder: str, size: str, attention: str = "auto", dtype: str = "float32",
                      async_scheduling: str = "0") -> None:
    """LLM(tensor_parallel_size=size): greedy tokens and logprobs of a batch (prefix
    caching on, chunked prefill, a preemption forced by a small KV pool) equal one
    device's; nothing compiles after warm-up. `async_scheduling` "1": the sharded
    engine schedules asynchronously (the one device's does not)."""
    from jaxllm import LLM
    from jaxllm.attention.kv_cache import KV_CACHE_FORMATS
    from jaxllm.loaders import load_model
    from jaxllm.models.parallel import shard_config

    prompts, params = shared_prefix_batch()
    cfg = load_model(folder, dtype).config

    def options(tp: int) -> dict:  # 10 blocks of 16 on each device, whatever its share of the KV heads
        shard = shard_config(cfg, tp)
        kv_block = KV_CACHE_FORMATS["float32"].token_bytes(shard.num_layers, shard.num_kv_heads, shard.head_dim) * 16
        return dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                    kv_cache_memory=10 * kv_block, progress=False, **LAZY, attention_backend=attention, dtype=dtype)

    runs = []
    for tp in (1, int(size)):
        llm = LLM(folder, tensor_parallel_size=tp, async_scheduling=tp > 1 and async_scheduling == "1", **options(tp))
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.llm_engine.core
        assert core.runner.num_compilations_after_warmup == 0
        runs.append((outs, core.scheduler.num_preemptions))
        if tp > 1:
            w = core.runner.weights["xla"].layers[0].wqkv
            w = getattr(w, "q", w)  # a kept GGUF's (the default SmolLM2's Q4_1) values, sharded as a float matrix is
            assert len(w.sharding.device_set) == tp and w.addressable_shards[0].data.shape[1] == w.shape[1] // tp
            _check_bytes_per_device(cfg, core.runner.weights["xla"], tp)
    (one, preempted), (many, _) = runs
    assert preempted > 0
    assert_same_greedy(one, many)
    print("ok", folder, size, attention, runs[0][1], runs[1][1])


def lora_matches(folder: str, adapters_dir: str, tensor: str, pipeline: str = "1") -> None:
    """LLM(enable_lora=True) over `pipeline` stages of `tensor` shards: two adapters and
    the base model in one batch give one device's tokens and logprobs; each slot's A and
    B split as their projections (o / down: A by its inputs; q | k | v, gate | up: B by
    its columns), stacked by stage as the layers are (each stage its layers' slots)."""
    from jaxllm import LLM, LoRARequest

    sys.path.insert(0, str(ROOT / "scripts"))  # a subprocess: no pytest pythonpath here
    import make_test_model
    out = Path(adapters_dir)
    loras = [LoRARequest(f"a{i}", i, str(make_test_model.write_lora_adapter(Path(folder), out / f"a{i}", rank=8,
                                                                            seed=i, scale=0.1)))
             for i in (1, 2)]
    prompts, params = shared_prefix_batch()
    requests = [loras[0], None, loras[1], loras[0], loras[1]]
    pp, tp = int(pipeline), int(tensor)
    runs = []
    for p, t in ((1, 1), (pp, tp)):
        llm = LLM(folder, tensor_parallel_size=t, pipeline_parallel_size=p, enable_lora=True, max_loras=2,
                  max_lora_rank=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, progress=False, **LAZY)
        runs.append(llm.generate(prompts, params, use_tqdm=False, lora_request=requests))
        runner = llm.llm_engine.core.runner
        assert runner.num_compilations_after_warmup == 0
        if p * t > 1:
            layer = runner.lora.weights.layers[0]
            lead = (p,) if p > 1 else ()  # stacked by stage, one stage per device row
            wo, q = layer["wo"].a, layer["wqkv"].b[0]
            assert wo.addressable_shards[0].data.shape == (*(1,) * len(lead), wo.shape[len(lead)] // t,
                                                           *wo.shape[len(lead) + 1:])
            assert q.addressable_shards[0].data.shape[-1] == q.shape[-1] // t
            assert wo.shape[:len(lead)] == lead and len(wo.sharding.device_set) == p * t
    one, many = runs
    assert_same_greedy(one, many)
    print("ok", folder, pp, tp)


MULTIHOST_PROMPTS = [[int(t) for t in range(5 + 11 * i, 30 + 11 * i)] for i in range(5)]


def _check_bytes_per_device(cfg, weights, tp: int) -> None:
    """Each device holds 1/tp of every sharded parameter (as laid out: with KV heads
    replicated where they must be) and all of the replicated ones, the norms; nothing
    more."""
    import jax

    per_device: dict = {}
    want = total = norms = 0
    for leaf in jax.tree.leaves(weights):  # float weights, or a kept GGUF's values, scales and mins
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        total += leaf.nbytes
        if leaf.sharding.is_fully_replicated:
            assert leaf.ndim == 1 and leaf.shape[0] in (cfg.hidden_size, cfg.head_dim), leaf.shape  # a norm
            norms += leaf.nbytes
        want += leaf.nbytes if leaf.sharding.is_fully_replicated else leaf.nbytes // tp
    assert len(per_device) == tp and all(b == want for b in per_device.values()), (per_device, want)
    print(f"bytes per device at TP={tp}: {want} of {total} ({norms} replicated)")


def pp_logits_match(folder: str, stages: str, shards: str = "1", attention: str = "cpu") -> None:
    """Pipelined logits (`stages` x `shards` tensor-parallel) equal one device's within
    1e-5 of their scale: one prefill, chunked prefill, token by token, a mixed step."""
    import numpy as np

    from jaxllm.attention.backends import get_attention_fn
    from jaxllm.loaders import load_model
    from tests.support.paged_driver import PagedDriver

    model = load_model(folder, dtype="float32")
    ids = model.tokenizer.encode(PROMPT)
    fn = get_attention_fn(attention)
    one = PagedDriver(model.config, model.params, block_size=8, attention_fn=fn)
    pp = PagedDriver(model.config, model.params, block_size=8, attention_fn=fn,
                     pipeline_parallel_size=int(stages), tensor_parallel_size=int(shards))
    for chunks in ([len(ids)], [5, 7, 1, len(ids) - 13], [1] * 6):
        want = one.prompt_logits(ids[:sum(chunks)], chunks)
        got = pp.prompt_logits(ids[:sum(chunks)], chunks)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0, err_msg=f"chunks={chunks}")
    a, b = ids, model.tokenizer.encode("Hello world! How are you today?")
    outs = []
    for driver in (one, pp):
        sa, sb = driver.new_sequence(a), driver.new_sequence(b)
        (a1,) = driver.step([(sa, len(a) - 1)], all_logits=True)
        a2, b1 = driver.step([(sa, 1), (sb, len(b))], all_logits=True)
        outs.append(np.concatenate([a1, a2, b1]))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5 * np.abs(outs[0]).max(), rtol=0)
    print("ok", folder, stages, shards, attention)


def pp_engine_matches(folder: str, pipeline: str, tensor: str = "1", attention: str = "cpu",
                      async_scheduling: str = "0") -> None:
    """LLM(pipeline_parallel_size=pipeline, tensor_parallel_size=tensor): greedy tokens
    and logprobs of a batch (prefix caching on, chunked prefill, a preemption forced by
    a small KV pool) equal one device's; nothing compiles after warm-up; each device
    holds its stage's layers (its shard of them) and its share of the vocabulary, and
    its stage's KV cache slots."""
    from jaxllm import LLM
    from jaxllm.attention.kv_cache import KV_CACHE_FORMATS
    from jaxllm.loaders import load_model
    from jaxllm.models import pipeline as pl
    from jaxllm.models.parallel import shard_config

    prompts, params = shared_prefix_batch()
    loaded = load_model(folder, "float32")
    cfg = loaded.config
    pp, tp = int(pipeline), int(tensor)

    def options(pp: int, tp: int) -> dict:  # 10 blocks of 16 per KV cache group on each device
        groups = cfg.kv_cache_groups()
        shard, slots = shard_config(cfg, tp), pl.cache_slots(pl.StagePlan(cfg.num_layers, pp), groups).count
        kv_block = KV_CACHE_FORMATS["float32"].token_bytes(slots, shard.num_kv_heads, shard.head_dim) * 16
        return dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                    kv_cache_memory=10 * groups.num_groups * kv_block, kv_cache_dtype="float32", progress=False, **LAZY,
                    attention_backend=attention, dtype="float32", linear_backend="xla",
                    activation_quantization="none")  # the stages' arithmetic: XLA's dot of float activations

    runs = []
    for p, t in ((1, 1), (pp, tp)):
        llm = LLM(folder, pipeline_parallel_size=p, tensor_parallel_size=t,
                  async_scheduling=p > 1 and async_scheduling == "1", **options(p, t))
        outs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.llm_engine.core
        assert core.runner.num_compilations_after_warmup == 0
        runs.append((outs, core.scheduler.num_preemptions))
        if p > 1:
            _check_stage_bytes(cfg, core.runner, loaded.params, pp, tp)
    (one, preempted), (many, _) = runs
    assert preempted > 0
    assert_same_greedy(one, many)
    print("ok", folder, pp, tp, runs[0][1], runs[1][1])


def _check_stage_bytes(cfg, runner, loaded, pp: int, tp: int) -> None:
    """Each device holds, of the weights, its stage's layers as loaded (`loaded`; laid
    out for tp shards), their projections / tp and their norms whole (a shorter stage: zeros in the longest's
    place), 1 / (pp x tp) of the embedding and output projection and the final norm;
    of the KV cache, its stage's slots of its KV heads."""
    import jax

    from jaxllm.models import pipeline as pl
    from jaxllm.models.params import shard_major

    loaded = shard_major(cfg, loaded, tp)  # K/V heads repeated where the shards outnumber them
    plan = pl.StagePlan(cfg.num_layers, pp)
    share = lambda lp: sum(a.nbytes if a.ndim == 1 else a.nbytes // tp for a in jax.tree.leaves(lp))
    vocab = sum(a.nbytes for a in jax.tree.leaves((loaded.embed, loaded.lm_head))) // (pp * tp)
    held: dict = {}
    for leaf in jax.tree.leaves(runner.weights["xla"]):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    for stage, (first, end) in enumerate(plan.bounds):
        layers = sum(share(loaded.layers[i]) for i in range(first, end))
        layers += (plan.depth - (end - first)) * share(loaded.layers[0])
        want = layers + vocab + loaded.final_norm.nbytes
        for device in runner.mesh.devices[stage]:
            assert held[device] == want, (stage, device, held[device], want)
    rows = runner.kv_caches[0].k  # [pp x blocks, block_size, KV heads, head_dim]
    assert rows.shape[0] == pp * runner.runner_config.num_blocks  # each stage a whole pool of its layers
    shard = rows.addressable_shards[0].data
    assert len(rows.sharding.device_set) == pp * tp and shard.shape[0] == rows.shape[0] // pp
    assert shard.shape[2] == max(1, cfg.num_kv_heads // tp)
    assert len(runner.kv_caches) == pl.cache_slots(plan, runner.kv_groups).count
    print(f"PP={pp} x TP={tp}: {sorted(set(held.values()))} weight bytes per device; "
          f"{len(runner.kv_caches)} cache slots per stage")


def engine_tokens(folder: str, attention: str, dtype: str, out: str, quantization: str | None = None) -> None:
    """Greedy tokens and top-2 logprobs of a batch through LLM (shared prefix, chunked
    prefill) on this process's default platform, written as JSON to `out`."""
    import json

    import jax

    from jaxllm import LLM

    prompts, params = shared_prefix_batch()
    llm = LLM(folder, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
              attention_backend=attention, dtype=dtype, quantization=quantization, progress=False, **LAZY)
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = [{"tokens": o.outputs[0].token_ids,
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]
    Path(out).write_text(json.dumps({"platform": jax.default_backend(), "rows": rows}))


def platform_tokens_match(folder: str, dtype: str = "float32", tol: str = "1e-3", quantization: str | None = None,
                          attention: str = "pallas") -> None:
    """The engine on the default platform (a GPU: attention `attention`) gives the CPU
    backend's (attention "xla") greedy tokens exactly and its logprobs within `tol`,
    both at full float32 matmul precision (TF32 would flip near-tied tokens), with the
    projections quantized as `quantization` says on both."""
    import json
    import tempfile

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, backend, extra in (("default", attention, {}), ("cpu", "xla", {"JAX_PLATFORMS": "cpu"})):
            out = str(Path(tmp) / f"{name}.json")
            env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest", **extra,
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            code = (f"import tests.support.multidevice as m; "
                    f"m.engine_tokens({folder!r}, {backend!r}, {dtype!r}, {out!r}, {quantization!r})")
            subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, timeout=600)
            runs[name] = json.loads(Path(out).read_text())
    a, b = runs["default"]["rows"], runs["cpu"]["rows"]
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x["tokens"] == y["tokens"], (i, x["tokens"], y["tokens"])
        for sx, sy in zip(x["logprobs"], y["logprobs"]):
            worst = max([worst] + [abs(sx[t] - sy[t]) for t in sx if t in sy])
    assert worst < float(tol), worst
    print(f"ok: {runs['default']['platform']} ({attention}) == cpu (xla), weights {quantization or 'as stored'}: "
          f"{len(a)} requests x 24 tokens identical, max logprob diff {worst:.2e}")


def pallas_engine_calls_match(folder: str, tol: str = "1e-4", dump: str = "") -> None:
    """tests/kernels/test_pallas_engine.py's workload through LLM with attention "pallas", every
    attention call the engine makes captured (its inputs, as the step passes them, and
    its output inside the step) and replayed through the kernel alone and the jnp
    reference on this platform; fails if any call's real rows differ by more than `tol`
    (or, in a bfloat16 step, than its rounding), naming each such call's step (T, S,
    q_lens, kv_lens) and how far the kernel inside the step and alone are from the
    reference. It showed the H100's differing tokens to be bfloat16 rounding
    (docs/kernels.md). With `dump` (a folder), the first differing call's inputs and
    outputs are saved there as an .npz (floating arrays as float32, exactly)."""
    import functools
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxllm.attention.backends as backends
    import pallas_kernels
    from jaxllm import LLM
    from jaxllm.attention.kv_cache import as_elements

    calls, original = [], backends._pallas_attention

    def record(static, args, arrays, out):
        calls.append((static, [np.asarray(x) for x in args], {k: np.asarray(v) for k, v in arrays.items()},
                      np.asarray(out)))

    def capture(q, k_cache, v_cache, *args, cache_dtype="", **kwargs):  # traced once per step shape
        out = original(q, k_cache, v_cache, *args, cache_dtype=cache_dtype, **kwargs)
        kwargs.pop("common_prefix_blocks", None)
        arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}  # an int8 cache's scales
        static = {k: v for k, v in kwargs.items() if k not in arrays}
        caches = [as_elements(c, cache_dtype) for c in (k_cache, v_cache)]
        jax.debug.callback(functools.partial(record, static), [q, *caches, *args], arrays, out)  # every step
        return out

    backends._pallas_attention = capture
    prompts, params = pallas_engine_workload()
    with tempfile.TemporaryDirectory() as cache:  # a fresh compile: stored executables lack the callback
        llm = LLM(folder, attention_backend="pallas", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  kv_cache_memory="8MiB", progress=False, compilation_cache_dir=cache)  # each call copies the caches
        llm.generate(prompts, params, use_tqdm=False)
    interpret = jax.default_backend() != "gpu"
    bad = []
    for i, (kw, (q, kc, vc, kv_lens, tables, qsl, num_seqs), arrays, in_step) in enumerate(calls):
        n = int(np.reshape(num_seqs, -1)[0])
        rows = int(qsl[n])
        args = [jnp.asarray(a) for a in (q, kc, vc, kv_lens, tables, qsl, num_seqs)]
        kw = dict(kw, **{k: jnp.asarray(v) for k, v in arrays.items()})
        alone = np.asarray(pallas_kernels.ragged_paged_attention(*args, interpret=interpret, **kw), np.float32)
        want = np.asarray(pallas_kernels.ragged_paged_attention_reference(*args, **kw), np.float32)
        errs = {name: float(np.nan_to_num(np.abs(np.asarray(x, np.float32)[:rows] - want[:rows]), nan=np.inf).max())
                      if rows else 0.0
                for name, x in (("in the step", in_step), ("alone", alone))}
        # a bfloat16 step (a GPU's default) against the float32 reference: within its rounding
        bound = max(float(tol), float(jnp.finfo(q.dtype).eps) * float(np.abs(want[:rows]).max(initial=1.0)))
        if max(errs.values()) > bound:
            step = f"call {i}: T={q.shape[0]} S={tables.shape[0]} q_lens={np.diff(qsl)[:n].tolist()} " \
                   f"kv_lens={kv_lens[:n].tolist()}"
            bad.append(f"{step}: max |kernel - reference| " + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()))
            if dump and len(bad) == 1:  # npz has no bfloat16: floating arrays as float32 (exact), int8 as it is
                exact = {k: a if a.dtype == np.int8 else a.astype(np.float32)
                         for k, a in dict(q=q, k_cache=kc, v_cache=vc, in_step=in_step).items()}
                np.savez(f"{dump}/pallas_call_{i}.npz", kv_lens=kv_lens, block_tables=tables, query_start_loc=qsl,
                         num_seqs=num_seqs, alone=alone, reference=want, kwargs=repr(kw), **exact, **arrays)
    assert not bad, f"{len(bad)} of {len(calls)} calls differ:\n" + "\n".join(bad)
    print(f"ok: {len(calls)} attention calls of the engine replayed on {jax.default_backend()}: kernel == reference "
          f"(within {np.dtype(calls[0][1][0].dtype).name} rounding)" if calls else "ok: no attention calls")


def tp_update_weights(folder: str, size: str) -> None:
    """update_weights of a tensor-parallel engine with a trainer's arrays sharded as the
    engine shards them (jaxllm.models.parallel.param_shardings): the engine takes every
    array it multiplies as laid out (all but the fused q|k|v and gate|up) as it is, the
    fused ones relaid out on the devices; the process's live bytes grow by no second
    copy of the weights; the tokens are a one-device engine's with the same update."""
    import jax

    from jaxllm import LLM
    from jaxllm.loaders import load_model
    from jaxllm.models.parallel import param_shardings
    from tests.engine.test_update_weights import trained

    prompts, params = shared_prefix_batch()
    options = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, progress=False, **LAZY,
                   attention_backend="cpu", linear_backend="xla")
    loaded = load_model(folder, "float32")
    new = trained(loaded.params, seed=7)
    one = LLM(folder, **options)
    one.update_weights(new)
    want = one.generate(prompts, params, use_tqdm=False)
    del one

    llm = LLM(folder, tensor_parallel_size=int(size), **options)
    runner = llm.llm_engine.core.runner
    given = jax.device_put(new, param_shardings(loaded.config, runner.mesh))  # the trainer's, sharded as the engine's
    live = lambda: sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
    old = sum(a.nbytes for a in jax.tree.leaves(runner.weights))
    before = live()
    llm.update_weights(given)
    taken = [(a is b) for a, b in zip(jax.tree.leaves(runner.weights["xla"]), jax.tree.leaves(given), strict=True)]
    fused = {id(lp.wqkv) for lp in runner.weights["xla"].layers} | {id(lp.w_gate_up) for lp in runner.weights["xla"].layers}
    made = sum(a.nbytes for a in jax.tree.leaves(runner.weights["xla"]) if id(a) in fused)
    assert all(t for t, a in zip(taken, jax.tree.leaves(runner.weights["xla"])) if id(a) not in fused), taken
    assert not any(t for t, a in zip(taken, jax.tree.leaves(runner.weights["xla"])) if id(a) in fused)
    assert live() - before <= made - old, (live() - before, made, old)  # the old weights gone, only the fused made
    assert_same_greedy(want, llm.generate(prompts, params, use_tqdm=False))
    print(f"ok: TP={size} update took {sum(taken)} of {len(taken)} arrays as given; relaid out {made} bytes")
