#!/usr/bin/env python
"""Where a served workload's time goes, per step kind and per part of the step (issue 59).

Runs the standard workload (scripts/bench_serving.py's prompts U[32, 512], outputs
U[16, 256]; the first `--num-prompts`) offline through one engine that admits
`--max-num-seqs` at a time, as that many closed-loop clients would (offline and served
rates agree: docs/bench-log/2026-11-29-against-vllm.md). Then,
for each step shape the workload ran, it calls that shape's executable alone on the
last step of it the workload scheduled, under JAX's profiler, and splits the device
time by the model's named scopes (jaxllm/models/llama.py: qkv_proj, attention,
kv_write, o_proj, mlp, logits, ...; what no scope names, such as the sampler and the
norms, is "other"), reading each thunk's scope from the compiled step's HLO metadata.

Printed: per shape, the calls the workload made, their time per call from dispatch to
result ("in flight": under async scheduling it includes the rest of the call before, so
these overlap and sum past the wall), one call run alone ("total": the median of
`--reps` calls without the profiler; "traced": the same under it, which slows the
thunks) and its parts under the profiler (each the median of `--reps` calls; they sum
to about the traced time); then the workload's seconds by part (each
shape's parts times its calls) and the host's share (wall minus the untraced time of
the calls alone).

    .venv/bin/python scripts/profile_serving.py
    .venv/bin/python scripts/profile_serving.py --engine-args "--kv-cache-dtype bfloat16" --out p.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SCOPES = ("qkv_proj", "rope", "kv_write", "attention", "o_proj", "mlp", "moe", "logits")


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Each instruction of an optimized HLO module to the first named scope in its
    metadata's op_name (a fusion's own metadata is that of its root); "other" if none."""
    scopes = {}
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"", re.M)
    for name, op_name in pattern.findall(hlo_text):
        parts = op_name.split("/")
        scopes[name] = next((s for p in parts for s in SCOPES if p == s), "other")
    return scopes


CALL = "profile_serving.call"  # the annotation around each profiled call


def _trace_events(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the perfetto trace under `trace_dir`."""
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def _thunks(events: list[dict]):
    """(hlo_op, start, seconds) of each thunk among `events`."""
    for e in events:
        op = e.get("args", {}).get("hlo_op")
        if op and not e["name"].startswith("end:"):
            yield op, e["ts"], e["dur"] * 1e-6


def thunk_seconds_per_call(trace_dir: str, name: str = CALL) -> list[dict[str, float]]:
    """Seconds per HLO op of each call annotated `name` (jax.profiler.TraceAnnotation),
    in order: the thunks that start inside its window."""
    events = _trace_events(trace_dir)
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name)
    calls: list[dict[str, float]] = [collections.defaultdict(float) for _ in windows]
    for op, start, seconds in _thunks(events):
        i = next((i for i, (a, b) in enumerate(windows) if a <= start <= b), None)
        if i is not None:
            calls[i][op] += seconds
    return calls


def profile_shape(runner, step, reps: int, top_other: int) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of `step`'s executable alone, by scope (and "total"), each the median over
    `reps` calls (one call disturbed on a shared machine moves a mean, not a median: once
    it put the parts' sum over the workload's wall); and the `top_other` HLO ops no
    scope names, with their mean seconds."""
    import jax
    import numpy as np

    runner.time_step_alone(step, 2)  # warm
    scopes = op_scopes(runner.compilation.get(step.shape).as_text())
    untraced = [runner.time_step_alone(step, 1) for _ in range(reps)]
    walls = []
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(reps):
            with jax.profiler.TraceAnnotation(CALL):
                walls.append(runner.time_step_alone(step, 1))
        jax.profiler.stop_trace()
        calls = thunk_seconds_per_call(d)
    by_call = [_summed(per_op, lambda op: scopes.get(op, "other")) for per_op in calls]
    parts = {k: float(np.median([c.get(k, 0.0) for c in by_call])) for k in {k for c in by_call for k in c}}
    parts["total"], parts["traced"] = float(np.median(untraced)), float(np.median(walls))
    mean: dict[str, float] = collections.defaultdict(float)  # per op, over the calls
    for per_op in calls:
        for op, s in per_op.items():
            mean[op] += s / len(calls)
    unnamed = sorted(((s, op) for op, s in mean.items() if scopes.get(op, "other") == "other"), reverse=True)
    return parts, {op: s for s, op in unnamed[:top_other]}


def _summed(seconds: dict[str, float], key) -> dict[str, float]:
    """`seconds` (per op) summed by `key(op)`."""
    out: dict[str, float] = collections.defaultdict(float)
    for op, s in seconds.items():
        out[key(op)] += s
    return out


def run(args) -> dict:
    from bench_serving import standard_dataset

    from jaxllm import LLM, SamplingParams

    overrides = engine_overrides(args.engine_args)
    llm = LLM(**{"max_num_seqs": args.max_num_seqs, **overrides})
    core = llm.llm_engine.core
    runner = core.runner
    last: dict = {}
    dispatch = runner.dispatch

    def recording(sched, *a, **k):
        flight = dispatch(sched, *a, **k)
        if flight is not None:
            last[flight.step.shape] = flight.step
        return flight

    runner.dispatch = recording
    reqs = standard_dataset(args.num_prompts)
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs]
    runner.stats = type(runner.stats)()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    runner.dispatch = dispatch
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    st = runner.stats
    shapes = []
    for shape, step in sorted(last.items(), key=lambda kv: tuple(kv[0])):
        key = (shape.tokens, shape.seqs) + ((shape.decode_steps,) if shape.decode_steps > 1 else ())
        calls, seconds = st.steps_per_bucket.get(key, 0), st.seconds_per_bucket.get(key, 0.0)
        parts, other = profile_shape(runner, step, args.reps, args.top_other)
        shapes.append({"shape": "x".join(map(str, key)), "calls": calls, "in_flight_ms": 1e3 * seconds / max(calls, 1),
                       "alone_ms": {k: 1e3 * v for k, v in parts.items()},
                       "other_ops_ms": {k: 1e3 * v for k, v in other.items()}})
    totals: dict[str, float] = collections.defaultdict(float)
    for s in shapes:
        for k, v in s["alone_ms"].items():
            totals[k] += v * s["calls"] / 1e3
    return {"engine": core.describe(), "engine_args": args.engine_args, "wall_s": wall,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / wall, "shapes": shapes,
            "workload_seconds": dict(totals), "host_s": wall - totals["total"]}


def engine_overrides(text: str) -> dict:
    """`--kv-cache-dtype bfloat16 --dtype bfloat16` to {"kv_cache_dtype": "bfloat16", ...},
    through the server's own option parser."""
    from jaxllm.engine.config import add_cli_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    ns, defaults = vars(p.parse_args(shlex.split(text))), vars(p.parse_args([]))
    return {k: v for k, v in ns.items() if v != defaults[k]}


def print_report(r: dict) -> None:
    cols = ["total", "traced", *SCOPES, "other"]
    cols = [c for c in cols if c in ("total", "traced") or any(c in s["alone_ms"] for s in r["shapes"])]
    print(r["engine"])
    print(f"\nworkload: {r['output_tokens']} output tokens in {r['wall_s']:.1f} s = {r['output_tok_s']:.1f} tok/s")
    print(f"\n{'shape':>10} {'calls':>5} {'in flight':>9} | alone ms: " + " ".join(f"{c:>9}" for c in cols))
    for s in r["shapes"]:
        print(f"{s['shape']:>10} {s['calls']:5d} {s['in_flight_ms']:9.1f} |           "
              + " ".join(f"{s['alone_ms'].get(c, 0.0):9.2f}" for c in cols))
        if s.get("other_ops_ms"):
            print(" " * 32 + "other: " + ", ".join(f"{op} {ms:.2f}" for op, ms in s["other_ops_ms"].items()))
    w = r["workload_seconds"]
    print(f"\nworkload seconds: wall {r['wall_s']:.2f}; host and gaps {r['host_s']:.2f}; "
          + "; ".join(f"{c} {w.get(c, 0.0):.2f} ({w.get(c, 0.0) / r['wall_s']:.0%})" for c in cols))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-args", default="", help="engine options as `python -m jaxllm.serve` takes them")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32, help="the clients: requests running at once")
    p.add_argument("--reps", type=int, default=5, help="calls of each step shape under the profiler (each part: their median)")
    p.add_argument("--top-other", type=int, default=0,
                   help="also print, per shape, this many of the HLO ops no scope names (\"other\") with their ms")
    p.add_argument("--out", default=None, help="also write the report as JSON")
    args = p.parse_args()
    report = run(args)
    print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
