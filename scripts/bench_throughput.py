#!/usr/bin/env python
"""Offline throughput: jaxllm against HF transformers `generate` on the same model.

The standard workload (issue 4): 200 requests, seed 0, prompts of random token ids
with lengths uniform in [32, 512], output lengths uniform in [16, 256], generated
exactly (ignore_eos, max_tokens = the drawn length), greedy.

- jaxllm: all requests queued at once into one engine (continuous batching); timed
  from queuing to the last output, start-up excluded (measured separately: a fresh
  process with an empty compilation cache dir, then again with the same dir).
- HF: the GGUF's dequantized weights exported to an HF folder, `generate` in static
  batches of 32 (in request order), left padding with attention masks, each batch
  running to its longest request; float32 and bfloat16.

Printed, all measured in this one run: output and total (prompt + output) tokens/s,
the ratios jaxllm/HF, jaxllm's model-FLOPs utilization (2 x matmul parameters x tokens
processed / wall time, against a jitted 2048^3 float32 jnp.dot timed in the same run,
just before and just after jaxllm's run: their mean, both printed; and against numpy's
OpenBLAS dot, which under `--isa avx2` is capped to AVX2 where XLA's is not),
the KV cache accounting at the step with the most blocks in use (blocks, tokens held,
waste = 1 - tokens / (blocks x block_size)), and where jaxllm's time went.

    .venv/bin/python scripts/bench_throughput.py                      # everything
    .venv/bin/python scripts/bench_throughput.py --num-requests 64 --skip-hf --skip-startup
    .venv/bin/python scripts/bench_throughput.py --hf-dtypes float32 --out results.json
    .venv/bin/python scripts/bench_throughput.py --startup-only                  # cold and warm start only
    .venv/bin/python scripts/bench_throughput.py --isa avx2 --compare-xla        # the AVX2 build, and all-xla

`--isa avx2` runs everything (jaxllm, the XLA dot, HF's torch) as on an AVX2-only CPU
(scripts/isa_build.py); `--compare-xla` runs jaxllm a second time with both backends
`xla` (the configuration the defaults must never fall below) and prints the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from isa_build import ISAS, describe, reexec

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- workload


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_forward_tokens(self) -> int:
        """Tokens a forward pass has to process: the prompt and every output but the
        last (the last sampled token is never fed back)."""
        return self.num_prompt_tokens + self.num_output_tokens - len(self.prompts)


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_len=(32, 512), output_len=(16, 256)) -> Workload:
    rng = np.random.default_rng(seed)
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, num_requests)
    olens = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in plens]
    return Workload(prompts, [int(n) for n in olens])


# ------------------------------------------------------------ matmul rate


def blas_rate(n: int = 2048, reps: int = 5) -> float:
    """Best-of-`reps` float32 GFLOP/s of numpy's n^3 dot (the OpenBLAS its wheel ships):
    the second MFU denominator, because under `--isa avx2` OpenBLAS is capped to its
    Haswell kernels where XLA's dot is not (scripts/isa_build.py)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    a @ a
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    """Best-of-`reps` float32 GFLOP/s of a jitted n^3 jnp.dot."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


# ------------------------------------------------------------------ jaxllm


def engine_options(args) -> dict:
    opts = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        async_scheduling=args.async_scheduling,
    )
    if args.num_scheduler_steps is not None:
        opts["num_scheduler_steps"] = args.num_scheduler_steps
    if args.kv_cache_memory is not None:
        opts["kv_cache_memory"] = args.kv_cache_memory
    if args.compilation_cache_dir is not None:
        opts["compilation_cache_dir"] = args.compilation_cache_dir
    return opts


def run_jaxllm(args, workload: Workload, **overrides) -> dict:
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, progress=not args.quiet, **(engine_options(args) | overrides))
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    core = engine.core
    runner = core.runner
    cfg = core.model.config
    block_size = core.kv_cache_manager.block_size

    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature, seed=i)
              for i, n in enumerate(workload.output_lens)]
    items = [(str(i), p, sp) for i, (p, sp) in enumerate(zip(workload.prompts, params))]

    # Sample the KV accounting after every step (the core's own stats of that step).
    samples: list[tuple[int, int]] = []
    timing = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    step_seqs: list[int] = []  # sequences in each step
    core_step = core.step

    def step():
        t_a = time.perf_counter()
        sched = core.scheduler.schedule()
        step_seqs.append(sched.num_scheduled_reqs)
        t_b = time.perf_counter()
        result = core.runner.execute_model(sched)
        t_c = time.perf_counter()
        out = core.scheduler.update_from_output(sched, result)
        t_d = time.perf_counter()
        timing["schedule"] += t_b - t_a
        timing["execute"] += t_c - t_b
        timing["update"] += t_d - t_c
        if out.stats is not None:
            samples.append((out.stats.num_blocks_used, out.stats.num_tokens_held))
        return out

    core.step = step
    runner.stats = type(runner.stats)()
    outputs_seen = 0
    start = time.perf_counter()
    engine.add_requests(items)
    finished = {}
    # Per engine step: wall time and the part spent waiting for the device; the rest
    # (scheduling, input preparation, dispatch, output processing, detokenization) is
    # the host gap between consecutive device steps.
    step_walls: list[float] = []
    step_waits: list[float] = []
    while engine.has_unfinished_requests():
        t_step, wait_before = time.perf_counter(), runner.stats.device_seconds
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step_walls.append(time.perf_counter() - t_step)
        step_waits.append(runner.stats.device_seconds - wait_before)
    wall = time.perf_counter() - start
    core.step = core_step
    outputs_seen = sum(len(o.outputs[0].token_ids) for o in finished.values())
    if outputs_seen != workload.num_output_tokens:
        raise RuntimeError(f"jaxllm produced {outputs_seen} output tokens, expected {workload.num_output_tokens}")

    st = runner.stats
    peak_blocks, peak_tokens = max(samples) if samples else (0, 0)
    waste_at_peak = 1 - peak_tokens / (peak_blocks * block_size) if peak_blocks else 0.0
    weighted = [(b, t) for b, t in samples if b]
    mean_waste = (1 - sum(t for _, t in weighted) / (block_size * sum(b for b, _ in weighted))) if weighted else 0.0
    flops = 2 * cfg.num_matmul_params * workload.num_forward_tokens
    full = [i for i, n in enumerate(step_seqs) if n >= args.max_num_seqs]
    gap = {
        "steps_at_max_num_seqs": len(full),
        "mean_step_seconds": sum(step_walls[i] for i in full) / len(full) if full else 0.0,
        "mean_gap_seconds": sum(step_walls[i] - step_waits[i] for i in full) / len(full) if full else 0.0,
    }
    gap["gap_fraction"] = gap["mean_gap_seconds"] / gap["mean_step_seconds"] if full else 0.0
    return {
        "host_gap": gap,
        "engine": llm.llm_engine.core.describe(),
        "options": engine_options(args),
        "startup_seconds_in_run": startup,
        "warmup_seconds": core.warmup_seconds,
        "num_buckets": len(runner.buckets),
        "wall_seconds": wall,
        "output_tokens": workload.num_output_tokens,
        "total_tokens": workload.num_prompt_tokens + workload.num_output_tokens,
        "output_tok_s": workload.num_output_tokens / wall,
        "total_tok_s": (workload.num_prompt_tokens + workload.num_output_tokens) / wall,
        "forward_tokens": workload.num_forward_tokens,
        "model_gflop_s": flops / wall / 1e9,
        "kv": {
            "block_size": block_size,
            "num_blocks": core.kv_cache_manager.num_usable_blocks,
            "peak_blocks_in_use": peak_blocks,
            "tokens_held_at_peak": peak_tokens,
            "waste_at_peak": waste_at_peak,
            "mean_waste": mean_waste,
            "num_preemptions": core.scheduler.num_preemptions,
        },
        "steps": {
            "num_steps": st.num_steps,
            "scheduled_tokens": st.num_tokens,
            "padded_tokens": st.num_padded_tokens,
            "token_padding": 1 - st.num_tokens / st.num_padded_tokens if st.num_padded_tokens else 0.0,
            "seqs_per_step": st.num_seqs / max(st.num_steps, 1),
            "schedule_seconds": timing["schedule"],
            "execute_seconds": timing["execute"],
            "update_seconds": timing["update"],
            "runner_host_seconds": st.host_seconds,
            "runner_device_wait_seconds": st.device_seconds,
            "runner_post_seconds": st.post_seconds,
            "frontend_seconds": wall - sum(timing.values()),
            "compilations_after_warmup": runner.num_compilations_after_warmup,
            # (tokens, seqs), and (tokens, seqs, decode steps) for multi-step calls
            "steps_per_bucket": {"x".join(map(str, k)): n for k, n in sorted(st.steps_per_bucket.items())},
            "seconds_per_bucket": {"x".join(map(str, k)): round(x, 3) for k, x in sorted(st.seconds_per_bucket.items())},
        },
    }


# ---------------------------------------------------------------------- HF


def export_hf_folder(model: str | None, folder: Path) -> None:
    from jaxllm.loaders import load_model
    from jaxllm.loaders.hf import save_hf_folder

    loaded = load_model(model, "float32")
    save_hf_folder(folder, loaded.config, loaded.params, loaded.tokenizer)


def run_hf(folder: Path, workload: Workload, dtype_name: str, batch_size: int, quiet: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    pad_id = 0
    n = len(workload.prompts)
    wall = 0.0
    batches = []
    for start in range(0, n, batch_size):
        idx = range(start, min(start + batch_size, n))
        prompts = [workload.prompts[i] for i in idx]
        max_new = max(workload.output_lens[i] for i in idx)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        t = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, pad_token_id=pad_id,
        )
        dt = time.perf_counter() - t
        assert out.shape[1] == width + max_new, out.shape
        wall += dt
        batches.append({"size": len(prompts), "prompt_width": width, "new_tokens": max_new, "seconds": dt})
        if not quiet:
            print(f"  HF {dtype_name} batch {start // batch_size + 1}/{-(-n // batch_size)}: "
                  f"{len(prompts)}x({width}+{max_new}) in {dt:.1f}s", flush=True)
    total = workload.num_prompt_tokens + workload.num_output_tokens
    return {
        "dtype": dtype_name,
        "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": wall,
        "output_tok_s": workload.num_output_tokens / wall,
        "total_tok_s": total / wall,
        "batches": batches,
    }


# ---------------------------------------------------------------- start-up


def startup_child(args) -> None:
    """Run in a fresh process: build the engine and report how long each part took."""
    t_start = time.perf_counter()
    from jaxllm import LLM

    t_import = time.perf_counter()
    llm = LLM(model=args.model, progress=False, **engine_options(args))
    t_ready = time.perf_counter()
    core = llm.llm_engine.core
    print(json.dumps({
        "import_seconds": t_import - t_start,
        "llm_seconds": t_ready - t_import,
        "load_seconds": core.model.load_seconds,
        "warmup_seconds": core.warmup_seconds,
        "num_buckets": len(core.runner.buckets),
        "loaded_executables": getattr(core.runner, "num_loaded_executables", 0),
    }), flush=True)


def measure_startup(args, cache_dir: str) -> dict:
    """Spawn a fresh process that builds an engine; ready = its report line arrives
    (interpreter start, imports, model load, KV cache, every bucket loaded/compiled)."""
    cmd = [sys.executable, str(HERE), "--startup-child", "--compilation-cache-dir", cache_dir,
           *startup_passthrough(args)]
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: the child never blocks on it
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        line = proc.stdout.readline()
        ready = time.perf_counter() - t
        proc.communicate()
        err.seek(0)
        if proc.returncode or not line.startswith("{"):
            raise RuntimeError(f"start-up child failed:\n{err.read()[-4000:]}")
    result = json.loads(line)
    result["process_seconds"] = ready
    return result


def startup_passthrough(args) -> list[str]:
    out = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
           "--attention-backend", args.attention_backend, "--linear-backend", args.linear_backend,
           "--kv-cache-dtype", args.kv_cache_dtype]
    if args.model:
        out += ["--model", args.model]
    if args.kv_cache_memory is not None:
        out += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    return out


# -------------------------------------------------------------------- main


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import jax

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-dtypes", default="float32,bfloat16")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-startup", action="store_true", help="skip the cold/warm start-up subprocesses")
    p.add_argument("--startup-only", action="store_true", help="measure only the cold/warm start-up")
    p.add_argument("--out", default=None, help="write everything to this JSON file")
    p.add_argument("--quiet", action="store_true")
    # engine options
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="jaxllm.config.KV_CACHE_DTYPES")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--linear-backend", default="auto")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--compilation-cache-dir", default=None)
    p.add_argument("--isa", choices=sorted(ISAS), default="native", help="avx2: as on an AVX2-only CPU")
    p.add_argument("--compare-xla", action="store_true", help="run jaxllm again with both backends xla")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's async_scheduling (on by default, as the engine's)")
    p.add_argument("--compare-async", action="store_true",
                   help="run jaxllm again with async_scheduling the other way, and print the ratio")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="the engine's num_scheduler_steps (decode steps per device call; default: the engine's)")
    p.add_argument("--compare-decode-steps", default="",
                   help="run jaxllm again with each of these num_scheduler_steps (comma-separated) and print "
                        "the ratios")
    p.add_argument("--startup-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.startup_child:
        if not reexec(args.isa):
            return
        print(describe(args.isa), flush=True)

    if args.startup_child:
        return startup_child(args)
    if args.out:  # made now, not after a half-hour run (a fresh clone has no bench_results/)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    from jaxllm.loaders import load_model

    results: dict = {"machine": machine(), "build": describe(args.isa), "args": vars(args)}
    vocab = load_model(args.model).config.vocab_size
    workload = make_workload(args.num_requests, args.seed, vocab)
    results["workload"] = {
        "num_requests": args.num_requests, "seed": args.seed,
        "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens,
    }
    print(f"workload: {args.num_requests} requests, {workload.num_prompt_tokens} prompt + "
          f"{workload.num_output_tokens} output tokens", flush=True)

    if not args.skip_startup:
        with tempfile.TemporaryDirectory(prefix="jaxllm-cc-") as cc:
            cold = measure_startup(args, cc)
            warm = measure_startup(args, cc)
        results["startup"] = {"cold": cold, "warm": warm}
        for name, r in (("cold", cold), ("warm", warm)):
            print(f"start-up {name}: {r['process_seconds']:.1f}s from spawn to ready "
                  f"(import {r['import_seconds']:.1f}s, LLM() {r['llm_seconds']:.1f}s: model load "
                  f"{r['load_seconds']:.1f}s, warm-up {r['warmup_seconds']:.1f}s for {r['num_buckets']} buckets, "
                  f"{r['loaded_executables']} loaded from the executable store)", flush=True)

    if args.startup_only:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        return

    # The matmul rate brackets jaxllm's run: on a shared machine the rate drifts by 10-20%
    # within minutes, and one snapshot before the run can catch a fast or a slow moment.
    mm_before, blas_before = matmul_rate(), blas_rate()
    print(f"float32 matmul rate before jaxllm (jitted 2048^3 jnp.dot, best of 5): {mm_before:.1f} GFLOP/s",
          flush=True)
    j = run_jaxllm(args, workload)
    mm_after, blas = matmul_rate(), (blas_before + blas_rate()) / 2
    mm = (mm_before + mm_after) / 2
    results["blas_gflop_s"] = blas
    print(f"float32 matmul rate after jaxllm: {mm_after:.1f} GFLOP/s; mean {mm:.1f}", flush=True)
    j["mfu"] = j["model_gflop_s"] / mm
    results["matmul_gflop_s"] = mm
    results["matmul_gflop_s_before_after"] = [mm_before, mm_after]
    results["jaxllm"] = j
    print(f"jaxllm: {j['wall_seconds']:.1f}s  output {j['output_tok_s']:.1f} tok/s  total {j['total_tok_s']:.1f} tok/s  "
          f"MFU {100 * j['mfu']:.1f}% ({j['model_gflop_s']:.1f} of {mm:.1f} GFLOP/s)", flush=True)
    print(f"jaxllm engine: {j['engine']}", flush=True)
    if args.compare_xla:
        x = run_jaxllm(args, workload, attention_backend="xla", linear_backend="xla")
        results["jaxllm_all_xla"] = x
        print(f"jaxllm, attention and linear xla: {x['wall_seconds']:.1f}s  output {x['output_tok_s']:.1f} tok/s; "
              f"defaults / all-xla = {j['output_tok_s'] / x['output_tok_s']:.2f}x", flush=True)
    if args.compare_async:
        other = not args.async_scheduling
        a = run_jaxllm(args, workload, async_scheduling=other)
        results["jaxllm_async" if other else "jaxllm_sync"] = a
        sync, asynchronous = (j, a) if other else (a, j)
        print(f"jaxllm, async_scheduling={other}: {a['wall_seconds']:.1f}s  output {a['output_tok_s']:.1f} tok/s; "
              f"async / sync = {asynchronous['output_tok_s'] / sync['output_tok_s']:.2f}x", flush=True)

    for k in [int(x) for x in args.compare_decode_steps.split(",") if x]:
        m = run_jaxllm(args, workload, num_scheduler_steps=k)
        results[f"jaxllm_decode_steps_{k}"] = m
        print(f"jaxllm, num_scheduler_steps={k}: {m['wall_seconds']:.1f}s  output {m['output_tok_s']:.1f} tok/s; "
              f"default run / this = {j['output_tok_s'] / m['output_tok_s']:.2f}x", flush=True)

    hf_results = {}
    if not args.skip_hf:
        with tempfile.TemporaryDirectory(prefix="jaxllm-hf-") as folder:
            export_hf_folder(args.model, Path(folder))
            for dtype in [d for d in args.hf_dtypes.split(",") if d]:
                hf_results[dtype] = run_hf(Path(folder), workload, dtype, args.hf_batch_size, args.quiet)
                h = hf_results[dtype]
                print(f"HF {dtype}: {h['wall_seconds']:.1f}s  output {h['output_tok_s']:.1f} tok/s  "
                      f"total {h['total_tok_s']:.1f} tok/s", flush=True)
    results["hf"] = hf_results

    print()
    print(f"{'':14s}{'wall s':>9s}{'output tok/s':>14s}{'total tok/s':>13s}{'jaxllm/x':>10s}")
    print(f"{'jaxllm':14s}{j['wall_seconds']:9.1f}{j['output_tok_s']:14.1f}{j['total_tok_s']:13.1f}{'':>10s}")
    results["ratios"] = {}
    if "jaxllm_all_xla" in results:
        x = results["jaxllm_all_xla"]
        ratio = j["output_tok_s"] / x["output_tok_s"]
        results["ratios"]["all_xla"] = ratio
        print(f"{'jaxllm all-xla':14s}{x['wall_seconds']:9.1f}{x['output_tok_s']:14.1f}{x['total_tok_s']:13.1f}"
              f"{ratio:9.2f}x")
    for dtype, h in hf_results.items():
        ratio = j["output_tok_s"] / h["output_tok_s"]
        results["ratios"][f"hf_{dtype}"] = ratio
        print(f"{'HF ' + dtype:14s}{h['wall_seconds']:9.1f}{h['output_tok_s']:14.1f}{h['total_tok_s']:13.1f}{ratio:9.2f}x")
    print(f"MFU: {100 * j['mfu']:.1f}% = 2 x {j['forward_tokens']} tokens x matmul params / {j['wall_seconds']:.1f}s "
          f"= {j['model_gflop_s']:.1f} GFLOP/s of {mm:.1f} measured (mean of {mm_before:.1f} before, {mm_after:.1f} after)")
    capped = ", its AVX2 kernels" if args.isa == "avx2" else ""
    print(f"MFU against numpy's OpenBLAS 2048^3 dot ({blas:.1f} GFLOP/s{capped}"
          f"; XLA's dot is not capped under --isa avx2): {100 * j['model_gflop_s'] / blas:.1f}%")
    kv = j["kv"]
    print(f"KV: peak {kv['peak_blocks_in_use']} of {kv['num_blocks']} blocks in use, {kv['tokens_held_at_peak']} tokens "
          f"held, waste at peak {100 * kv['waste_at_peak']:.2f}% (mean over steps {100 * kv['mean_waste']:.2f}%), "
          f"{kv['num_preemptions']} preemptions")
    s = j["steps"]
    print(f"steps: {s['num_steps']}, {s['seqs_per_step']:.1f} seqs/step, token padding {100 * s['token_padding']:.1f}%, "
          f"compilations after warm-up {s['compilations_after_warmup']}")
    print(f"time: schedule {s['schedule_seconds']:.1f}s, execute {s['execute_seconds']:.1f}s "
          f"(host prep+dispatch {s['runner_host_seconds']:.1f}s, device wait {s['runner_device_wait_seconds']:.1f}s, "
          f"post {s['runner_post_seconds']:.1f}s), update {s['update_seconds']:.1f}s, "
          f"frontend {s['frontend_seconds']:.1f}s")
    g = j["host_gap"]
    if args.async_scheduling:  # the wait spans the next step's host work: not separable from the step's
        print(f"host gap: not measured under async scheduling (a step at {args.max_num_seqs} running: "
              f"{1e3 * g['mean_step_seconds']:.0f} ms)")
    else:
        print(f"host gap between device steps at {args.max_num_seqs} running: {1e3 * g['mean_gap_seconds']:.1f} ms "
              f"of a {1e3 * g['mean_step_seconds']:.0f} ms step ({100 * g['gap_fraction']:.1f}%, "
              f"{g['steps_at_max_num_seqs']} steps)")
    if "startup" in results:
        c, w = results["startup"]["cold"], results["startup"]["warm"]
        print(f"start-up, spawn to ready: cold {c['process_seconds']:.1f}s (empty cache dir), "
              f"warm {w['process_seconds']:.1f}s (same dir again)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
