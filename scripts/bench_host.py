#!/usr/bin/env python
"""Host work per decode step: where the time between two device calls goes.

A tiny random Llama (hidden 128; 1 layer, and as many layers as SmolLM2's 30, since
per-leaf costs grow with the layer count) runs pure decode at 1, 64, 256 and 1024
running sequences through `EngineCore.step`, one decode step per call and, with
multi-step decode (`--decode-steps`, the engine's num_scheduler_steps), several. Each
configuration first admits every request and finishes their prompts, then times
`--steps` decode steps (forward passes: a call of K steps counts K) and prints, in
microseconds per decode step:

- schedule: `Scheduler.schedule` (and, under async scheduling, `add_placeholders`);
- build: the runner's numpy inputs for the bucket (`ModelRunner.prepare_step`);
- dispatch: the rest of `ModelRunner.dispatch` (row updates, transfers, the call);
- wait: from the call's return to the sampled ids (`RunnerStats.device_seconds`;
  under async scheduling this spans the next step's host work, so it overlaps the rest);
- record: the runner recording them (`RunnerStats.post_seconds`);
- update: `Scheduler.update_from_output` (stops, outputs, freeing blocks);
- host: the sum of the host's parts (everything but the wait);
- wall: the step's wall time; device: the last call's executable alone, called
  back to back on device-resident inputs (median of `--device-reps`, divided by the
  steps it runs); idle: the share of the wall time the device had nothing to do
  (1 - device / wall).

The phases are read by wrapping those methods on the engine's own objects, so the
script runs unchanged against an older tree: `--compare-tree PATH` (a worktree of an
earlier commit) runs it first, in a subprocess with that tree first on sys.path, and
prints both in one run. Ratios between trees are only meaningful within one run.

    .venv/bin/python scripts/bench_host.py                        # this tree, 1 and 30 layers
    .venv/bin/python scripts/bench_host.py --compare-tree /tmp/old --layers 30
    .venv/bin/python scripts/bench_host.py --seqs 64 --async-scheduling on,off --decode-steps 1,4,8
    python scripts/bench_host.py --model MODELS/llama-3.2-1b-full --dtype bfloat16 --seqs 1,64,256  # a GPU
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

HERE = Path(__file__).resolve().parent
PHASES = ("schedule", "build", "dispatch", "wait", "record", "update")


@dataclasses.dataclass
class Timers:
    """Seconds spent in each wrapped method since the last reset."""

    seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def wrap(self, obj, name: str, phase: str, exclude: str | None = None):
        """Time `obj.name` into `phase` (less what `exclude` took meanwhile)."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            before = self.seconds[exclude] if exclude else 0.0
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                taken = time.perf_counter() - t0
                self.seconds[phase] += taken - ((self.seconds[exclude] - before) if exclude else 0.0)

        setattr(obj, name, timed)


def machine() -> str:
    """The CPU, its vector ISA and the build (native: the other ISA's is not measured)."""
    sys.path.insert(0, str(HERE))
    from isa_build import describe

    return f"{describe('native')}; Python {platform.python_version()}"


def make_model(folder: Path, layers: int) -> Path:
    sys.path.insert(0, str(HERE))
    import make_test_model

    return make_test_model.write_model(folder, "llama", layers=layers)


def device_seconds(runner, step, reps: int) -> float:
    """The median seconds of the step's executable alone on device-resident inputs."""
    import jax
    import numpy as np

    if hasattr(runner, "time_step_alone"):
        return runner.time_step_alone(step, reps)
    # an older runner: call the executable as its dispatch did
    exe = runner._executable(step.t, step.s, step.r)  # (trees before time_step_alone)
    weights = runner.weights_of(runner.plan.for_bucket(step.t))
    inputs = jax.device_put(step.inputs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.kv_caches, runner.history, out = exe(weights, runner.rope, runner.kv_caches, runner.history, inputs)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_config(model: Path, num_seqs: int, steps: int, async_scheduling: bool, device_reps: int,
               decode_steps: int, dtype: str = "auto", kv_cache_memory: str = "2GiB") -> dict | None:
    import dataclasses
    import inspect

    from jaxllm.engine.config import EngineConfig
    from jaxllm.engine.core import EngineCore
    from jaxllm.messages import EngineCoreRequest
    from jaxllm.sampling_params import SamplingParams

    multi, fields = {}, {f.name for f in dataclasses.fields(EngineConfig)}
    if "num_scheduler_steps" in fields:
        multi = {"num_scheduler_steps": decode_steps}
    elif decode_steps > 1:
        return None  # a tree without multi-step decode
    prompt_len = 8
    # room for the prompts' admission (over many steps at 256 sequences: the decodes take the budget first),
    # settling and the timed steps, so no request finishes while timed
    max_model_len = 128 + steps + 8 * decode_steps
    # only the buckets this configuration runs, compiled on first use (a full warm-up of the
    # 1B model's buckets took minutes a configuration on the H200); none of them while timed.
    # An older tree takes it as EngineCore's argument, or not at all.
    lazy = {"warm_up": False} if "warm_up" in fields else {}
    config = EngineConfig(model=str(model), max_model_len=max_model_len, max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(num_seqs, 64), kv_cache_memory=kv_cache_memory, dtype=dtype,
                          async_scheduling=async_scheduling, enable_prefix_caching=False,
                          compilation_cache_dir=os.environ.get("BENCH_HOST_CACHE"), **multi, **lazy)
    old_lazy = {"warm_up": False} if "warm_up" in inspect.signature(EngineCore).parameters else {}
    core = EngineCore(config, progress=False, **old_lazy)
    params = SamplingParams(max_tokens=max_model_len - prompt_len, ignore_eos=True, temperature=0.0)
    core.add_requests([EngineCoreRequest(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(prompt_len)], params, None,
                                         time.time()) for i in range(num_seqs)])
    timers = Timers()
    runner, sched = core.runner, core.scheduler
    last = {}
    prepare = runner.prepare_step

    def keep(*args, **kwargs):
        last["step"] = prepare(*args, **kwargs)
        return last["step"]

    runner.prepare_step = keep
    timers.wrap(sched, "schedule", "schedule")
    if hasattr(sched, "add_placeholders"):
        timers.wrap(sched, "add_placeholders", "schedule")
    timers.wrap(sched, "update_from_output", "update")
    timers.wrap(runner, "prepare_step", "build")
    timers.wrap(runner, "dispatch", "dispatch", exclude="build")
    # admit every request and finish the prompts (a few steps), then settle
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.requests.values()) or not sched.running:
        core.step()
    for _ in range(3):
        core.step()
    if lazy:  # from here a compile is counted (and logged): the timed steps must not compile
        runner.compilation.warmed_up = True
    timers.seconds = dict.fromkeys(PHASES, 0.0)
    st = runner.stats
    model_steps = lambda: getattr(st, "num_model_steps", st.num_steps)
    dev0, post0, n0, m0 = st.device_seconds, st.post_seconds, st.num_steps, model_steps()
    t0 = time.perf_counter()
    while model_steps() - m0 < steps:
        n_before = st.num_steps
        core.step()
        assert st.num_steps == n_before + 1, "an engine step that ran no runner step"
    wall = time.perf_counter() - t0
    assert not lazy or runner.num_compilations_after_warmup == 0, "a timed step compiled its bucket"
    n = model_steps() - m0  # decode steps (forward passes), several per call with multi-step decode
    sec = dict(timers.seconds, wait=st.device_seconds - dev0, record=st.post_seconds - post0)
    # collect() is wrapped in neither: its wait and record come from the runner's stats
    per_step = {k: v / n * 1e6 for k, v in sec.items()}
    per_step["host"] = sum(v for k, v in per_step.items() if k != "wait")
    per_step["wall"] = wall / n * 1e6
    step = last["step"]
    iterations = 1  # a multi-step call's executable runs its steps (all of them: no request stops)
    if getattr(step, "shape", None) is not None and step.shape.decode_steps > 1:
        iterations = int(step.host.decode_steps.max())
    per_step["device"] = device_seconds(runner, step, device_reps) / iterations * 1e6
    per_step["idle"] = max(0.0, 1.0 - per_step["device"] / per_step["wall"])
    per_step["bucket"] = [step.t, step.s]
    assert len(step.host.rows) == num_seqs, f"the last step ran {len(step.host.rows)} of {num_seqs} sequences"
    per_step["calls"] = st.num_steps - n0
    return per_step


def child(args) -> None:
    out = {}
    models = [(args.model.name, args.model)] if args.model else [(f"{n}L", n) for n in args.layers]
    for name, model in models:
        with tempfile.TemporaryDirectory() as tmp:
            folder = model if isinstance(model, Path) else make_model(Path(tmp), model)
            for n in args.seqs:
                for mode in args.async_scheduling:
                    for k in args.decode_steps:
                        key = f"{name}/{n}/{mode}/{k}"
                        result = run_config(folder, n, args.steps, mode == "on", args.device_reps, k,
                                            args.dtype, args.kv_cache_memory)
                        if result is not None:
                            out[key] = result
                            print(json.dumps({key: result}), file=sys.stderr, flush=True)
    print(json.dumps(out))


def run_tree(tree: Path, args) -> dict:
    """Run the measurements in a subprocess importing jaxllm from `tree`."""
    cmd = [sys.executable, str(HERE / "bench_host.py"), "--child", "--steps", str(args.steps),
           "--device-reps", str(args.device_reps), "--layers", ",".join(map(str, args.layers)),
           "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory, *(["--model", str(args.model)]
                                                                                 if args.model else []),
           "--seqs", ",".join(map(str, args.seqs)), "--async-scheduling", ",".join(args.async_scheduling),
           "--decode-steps", ",".join(map(str, args.decode_steps))]
    # the tree first on the path, the rest kept (a GPU machine's carried wheels); the platform the parent's
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(name: str, results: dict) -> str:
    cols = (*PHASES, "host", "wall", "device")
    lines = [f"{name}", f"{'layers/seqs/async/K':<20}" + "".join(f"{c:>10}" for c in cols) + f"{'idle':>7}  bucket"]
    for key, r in results.items():
        lines.append(f"{key:<20}" + "".join(f"{r[c]:>10.0f}" for c in cols) + f"{r['idle']:>7.0%}  {r['bucket']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]
    p.add_argument("--layers", type=ints, default=[1, 30], help="model depths (comma-separated)")
    p.add_argument("--model", type=Path, default=None,
                   help="an HF folder to run instead of the tiny models (--layers ignored), e.g. "
                        "make_test_model.py's llama-3.2-1b on a GPU")
    p.add_argument("--dtype", default="auto", help="the engine's dtype")
    p.add_argument("--kv-cache-memory", default="2GiB", help="the engine's kv_cache_memory")
    p.add_argument("--seqs", type=ints, default=[1, 64, 256, 1024], help="running sequences (comma-separated)")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per configuration")
    p.add_argument("--device-reps", type=int, default=20, help="calls of the executable alone")
    p.add_argument("--async-scheduling", type=lambda s: s.split(","), default=["off", "on"],
                   help="on, off or on,off")
    p.add_argument("--decode-steps", type=ints, default=[1, 4],
                   help="num_scheduler_steps: decode steps per call (comma-separated; a tree without multi-step "
                        "decode runs 1 only)")
    p.add_argument("--compare-tree", type=Path, default=None, help="also run an older tree, first")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    results = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.compare_tree:
        results["before"] = run_tree(args.compare_tree, args)
    results["this tree"] = run_tree(HERE.parent, args)
    print(f"host work per decode step, microseconds ({results['machine']})")
    for name in ("before", "this tree"):
        if name in results:
            print(table(name, results[name]))
    if "before" in results:
        print("host work before / now (x):")
        for key, r in results["this tree"].items():
            b = results["before"].get(key)
            if b:
                print(f"  {key:<20} host {b['host'] / r['host']:.2f}x  wall {b['wall'] / r['wall']:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
