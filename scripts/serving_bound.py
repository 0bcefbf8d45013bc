#!/usr/bin/env python
"""How fast `make bench`'s served workload could run on this machine at most (issue 59).

The standard dataset's first 64 requests at 32 clients (scripts/bench_vllm.py's workload)
cost, per precision, a fixed number of FLOPs (bench_vllm.workload_flops) and, in its
decode steps, a fixed number of bytes: every weight once a step, and every cached K/V row
of every running sequence once a step. This script counts both, measures this machine's
rates in the same run (each precision's peak as bench_vllm measures it: the best 512 x
2048 x 2048 product; the memory's rate: two threads streaming a 1 GiB array), and prints
two bounds per precision:

- `overlapped`: the time if every byte moved while the arithmetic ran (the larger of all
  FLOPs at the peak and all bytes at the streaming rate): no engine can beat it;
- `in turn`: the FLOPs at the peak or the decode steps' weights at the streaming rate,
  whichever takes longer (the projections), plus the decode attention's K/V reads at the
  streaming rate, as engines run them (a step's attention reads its K/V with nearly no
  FLOPs, between the projections; the larger of the two sums, not of each step's, and
  scattered blocks read slower than a stream, so this too is generous).

Given a `make bench` result (`--vllm`), each target is also printed as a share of each
bound: the rate a target asks for, divided by the bound. The decode steps are counted as
the 32 clients would run them: each client takes the next request when its last ends,
one token a step (prompt steps ignored: they only add time).

    .venv/bin/python scripts/serving_bound.py --vllm bench_results/vllm_standard_zen4_1204_1850.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import threading
import time
from pathlib import Path

import numpy as np
from bench_eval import export_hf_folder
from bench_serving import standard_dataset
from bench_vllm import ROOT, model_flops_per_token, peak_gflops, workload_flops

TARGETS = {"float32": ("vLLM CPU, float32", 1.3), "bfloat16": ("vLLM CPU, bfloat16 (its default here)", 1.5),
           "default": ("vLLM CPU, bfloat16 (its default here)", 1.5)}
# Bytes a weight and a cached K/V value take in each precision's served configuration.
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "default": 0.5625}  # Q4_1: 18 bytes per 32
KV_BYTES = {"float32": 4, "bfloat16": 2, "default": 2}


def stream_rate(threads: int = 2, size: int = 1 << 30) -> float:
    """The rate `threads` threads read a `size`-byte array at, each taking its share's
    max (numpy releases the GIL; its vectorized max keeps up with the memory, where its
    pairwise sum is bound by its own additions: docs/bench-log/2026-12-05-xeon-amx.md):
    GB/s, the best of 3."""
    data = np.ones(size // 4, np.float32)
    share = len(data) // threads
    best = float("inf")
    for _ in range(3):
        parts = [threading.Thread(target=lambda i: data[i * share:(i + 1) * share].max(), args=(i,))
                 for i in range(threads)]
        start = time.perf_counter()
        for t in parts:
            t.start()
        for t in parts:
            t.join()
        best = min(best, time.perf_counter() - start)
    return size / best / 1e9


def decode_steps(requests, clients: int) -> list[list[int]]:
    """Per decode step, the context lengths of the sequences decoding in it."""
    free = [(0, c) for c in range(clients)]
    spans = []  # (first step, prompt length, output length)
    for req in requests:
        start, c = heapq.heappop(free)
        spans.append((start, len(req.prompt), req.output_len))
        heapq.heappush(free, (start + req.output_len, c))
    steps: list[list[int]] = [[] for _ in range(max(s + n for s, _, n in spans))]
    for start, prompt, n in spans:
        for i in range(n):
            steps[start + i].append(prompt + i)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", type=Path, help="a bench_vllm.py result (.json): the targets as shares of the bounds")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--clients", type=int, default=32)
    args = ap.parse_args()

    folder = export_hf_folder(ROOT / "build" / "smollm2-hf", None)  # as bench_vllm.py makes it
    cfg = json.loads((folder / "config.json").read_text())
    requests = standard_dataset(args.num_prompts)
    flops = workload_flops(requests, model_flops_per_token(folder))
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    params = (model_flops_per_token(folder)[0] + model_flops_per_token(folder)[1]) / 2  # layers + output projection
    steps = decode_steps(requests, args.clients)
    contexts = sum(sum(s) for s in steps)
    out_tokens = sum(r.output_len for r in requests)

    peaks = peak_gflops()
    stream = stream_rate()
    print(f"workload: {len(requests)} requests, {out_tokens} output tokens, {flops / 1e12:.2f} TFLOP, "
          f"{len(steps)} decode steps of {out_tokens / len(steps):.1f} sequences, {contexts / out_tokens:.0f} "
          f"tokens of context each on average")
    print(f"memory, two threads streaming: {stream:.1f} GB/s; peaks GFLOP/s {({k: round(v) for k, v in peaks.items()})}")
    rounds = json.loads(args.vllm.read_text())["rounds"] if args.vllm else []
    print(f"\n{'precision':<10} {'weights+KV a step':>18} {'overlapped':>11} {'in turn':>9} {'target':>16} "
          f"{'of overlapped':>14} {'of in turn':>11}")
    for name, peak in peaks.items():
        kv_token = 2 * layers * kv_heads * head_dim * KV_BYTES[name]
        weights = params * WEIGHT_BYTES[name]
        overlapped = max(flops / (peak * 1e9), (len(steps) * weights + contexts * kv_token) / (stream * 1e9))
        in_turn = max(flops / (peak * 1e9), len(steps) * weights / (stream * 1e9)) + contexts * kv_token / (stream * 1e9)
        label, factor = TARGETS[name]
        rates = [r[label]["output_token_throughput"] for r in rounds if label in r]
        target = factor * float(np.mean(rates)) if rates else None
        row = (f"{name:<10} {(weights + contexts / len(steps) * kv_token) / 1e6:>15.0f} MB "
               f"{out_tokens / overlapped:>7.0f} t/s {out_tokens / in_turn:>5.0f} t/s")
        if target:
            row += (f" {factor}x: {target:>6.0f} t/s {target / (out_tokens / overlapped):>13.0%} "
                    f"{target / (out_tokens / in_turn):>10.0%}")
        print(row)


if __name__ == "__main__":
    main()
