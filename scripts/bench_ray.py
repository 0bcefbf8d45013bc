"""What Ray's executor costs the step loop: an engine over two processes placed by Ray
against the same stages in one process.

    python scripts/bench_ray.py                       # the tiny llama test model, 32 sequences
    python scripts/bench_ray.py --out bench_results/ray.json

Starts a local Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster),
then runs the same greedy workload (bench_throughput's standard workload, shortened) at
`--max-num-seqs` running sequences, one configuration after the other, each in its own
process:

- mp: one process, 2 simulated CPU devices, pipeline_parallel_size 2;
- ray: two processes (one per node, 1 device each), pipeline_parallel_size 2, the
  stages' activations between the processes over gloo, each step sent to the worker by
  Ray.

Prints output tokens/s of each, the ratio, and process 0's host time per step in
`RayExecutor.send` (the per-step transport: an actor call per worker, not waited for).
The ratio is an upper bound on Ray's own cost: it also holds the collectives between
processes, which an engine on one host does not need (there, one JAX process drives
every device and `mp` is the executor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(args) -> dict:
    from bench_throughput import make_workload

    from jaxllm import LLM, SamplingParams

    options = dict(pipeline_parallel_size=2, max_model_len=1024, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=512, progress=False, dtype="float32", attention_backend="cpu")
    if args.executor == "ray":
        options |= dict(distributed_executor_backend="ray", num_processes=2)
    llm = LLM(args.model, **options)
    core = llm.llm_engine.core
    workload = make_workload(args.num_requests, 0, core.model.config.vocab_size, prompt_len=(32, 256),
                             output_len=(64, 128))
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    sends = (core.executor.sends, core.executor.send_seconds) if core.executor else (0, 0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"executor": args.executor, "seconds": wall, "output_tok_s": tokens / wall,
              "tokens": [o.outputs[0].token_ids for o in outs]}
    if core.executor:
        n, seconds = core.executor.sends - sends[0], core.executor.send_seconds - sends[1]
        result |= {"steps": n, "send_us_per_step": 1e6 * seconds / max(n, 1), "step_ms": 1e3 * wall / max(n, 1)}
    return result


def spawn(args, executor: str, env: dict) -> dict:
    from bench_pipeline import child_result

    cmd = [sys.executable, __file__, "--child", "--executor", executor, "--num-requests", str(args.num_requests),
           "--max-num-seqs", str(args.max_num_seqs), "--model", args.model]
    return child_result(cmd, env, executor)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: a tiny llama test model (scripts/make_test_model.py)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--executor", default="mp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args)))
        return
    import tempfile

    import make_test_model
    from ray.cluster_utils import Cluster

    if args.model is None:
        args.model = str(make_test_model.write_model(Path(tempfile.mkdtemp()), "llama"))
    base = dict(os.environ, JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]))
    base.pop("XLA_FLAGS", None)
    runs = {"mp": spawn(args, "mp", base | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        runs["ray"] = spawn(args, "ray", base | {"RAY_ADDRESS": cluster.address})
    finally:
        cluster.shutdown()
    same = runs["mp"].pop("tokens") == runs["ray"].pop("tokens")
    ratio = runs["mp"]["output_tok_s"] / runs["ray"]["output_tok_s"]
    for name, r in runs.items():
        print(f"{name:>3}: {r['output_tok_s']:8.1f} output tok/s ({r['seconds']:.1f} s)")
    ray = runs["ray"]
    print(f"ray: {ray['steps']} steps, {ray['step_ms']:.2f} ms a step, {ray['send_us_per_step']:.0f} us of it "
          f"sending the step ({ray['send_us_per_step'] / 10 / ray['step_ms']:.1f}%)")
    print(f"mp / ray: {ratio:.2f}x (target <= 1.1x); same tokens: {same}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"runs": runs, "mp_over_ray": ratio, "same_tokens": same,
                                              "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
