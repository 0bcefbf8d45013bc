"""Pipeline parallelism's bubble against tensor parallelism on the same devices.

    python scripts/bench_pipeline.py                   # Gemma 3 270M, 2 simulated CPU devices
    python scripts/bench_pipeline.py --devices 4 --num-requests 64 --out bench_results/pipeline.json

Runs the standard workload (prompts U[32, 512], outputs U[16, 256]: bench_throughput's)
through `LLM.generate` at `--max-num-seqs` running sequences, once per configuration,
one after another, each in its own process with `--devices` simulated devices:
TP = devices, PP = devices, and one device for scale. Prints each one's output tokens
per second and PP's ratio to TP (the issue's target: >= 0.8x at 32 running sequences).

What it measures on a CPU: the simulated devices share the machine's cores, so TP's
shards and PP's stages both split one pool of cores; the ratio shows what the pipeline
costs that TP does not (the ticks a stage idles while the pipeline fills and drains, the
smaller micro-batch matmuls, the activations passed between stages) against what TP
costs that PP does not (two all-reduces per layer). It cannot show the bandwidth of a
real interconnect, nor stages running on their own cores: on GPUs, an idle tick is an
idle device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def run_one(args) -> dict:
    """One configuration in this process: output tokens per second."""
    from bench_throughput import make_workload

    from jaxllm import LLM, SamplingParams

    llm = LLM(args.model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, max_model_len=1024,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, progress=False,
              attention_backend=args.attention_backend, quantization=args.quantization)
    workload = make_workload(args.num_requests, args.seed, llm.llm_engine.core.model.config.vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"tp": args.tp, "pp": args.pp, "seconds": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}
    return result | (phases(llm, args.max_num_seqs) if args.phases else {})


def phases(llm, n: int) -> dict:
    """Prefill alone (n new prompts of 480 tokens, one output token each: prompt tokens
    per second) and decode alone (the same prompts again, their prefixes cached, 96
    output tokens each: output tokens per second)."""
    from jaxllm import SamplingParams

    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, 480).tolist()} for _ in range(n)]
    timed = {}
    for name, max_tokens in (("prefill", 1), ("decode", 96)):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0), use_tqdm=False)
        timed[name] = time.perf_counter() - start
    return {"prefill_tok_s": n * 480 / timed["prefill"], "decode_tok_s": n * 96 / timed["decode"]}


def spawn(args, tp: int, pp: int) -> dict:
    devices = tp * pp
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                     f"--xla_force_host_platform_device_count={devices}".strip(),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                                                os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--pp", str(pp), "--num-requests",
           str(args.num_requests), "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
           str(args.max_num_batched_tokens), "--seed", str(args.seed), "--attention-backend", args.attention_backend,
           "--quantization", args.quantization] + (["--phases"] if args.phases else [])
    if args.model:
        cmd += ["--model", args.model]
    return child_result(cmd, env, f"tp={tp} pp={pp}")


def child_result(cmd: list[str], env: dict, name: str) -> dict:
    """The JSON a benchmark's child process prints last (it runs one configuration)."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m",
                   help="default: gemma-3-270m (its 4 heads split in 2 and 4; SmolLM2's 9 do not)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--attention-backend", default="cpu")
    p.add_argument("--quantization", default="none",
                   help="none (default): float weights, as TP and PP both multiply them (XLA's dot)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-one", action="store_true", help="skip the one-device run")
    p.add_argument("--phases", action="store_true",
                   help="also time prefill alone and decode alone (where PP loses against TP)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args)))
        return
    runs = {"tp": spawn(args, args.devices, 1), "pp": spawn(args, 1, args.devices)}
    if not args.skip_one:
        runs["one"] = spawn(args, 1, 1)
    for name, r in runs.items():
        print(f"{name:>3}: tp={r['tp']} pp={r['pp']}  {r['output_tok_s']:8.1f} output tok/s  ({r['seconds']:.1f} s)")
    ratio = runs["pp"]["output_tok_s"] / runs["tp"]["output_tok_s"]
    print(f"PP {args.devices} / TP {args.devices} on the same devices: {ratio:.2f}x (target >= 0.8x)")
    if args.phases:
        for phase in ("prefill", "decode"):
            tp, pp = runs["tp"][f"{phase}_tok_s"], runs["pp"][f"{phase}_tok_s"]
            print(f"{phase:>7} alone: TP {tp:8.1f}  PP {pp:8.1f} tok/s  PP / TP {pp / tp:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": runs, "pp_over_tp": ratio, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
