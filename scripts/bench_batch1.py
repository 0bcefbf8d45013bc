#!/usr/bin/env python
"""Batch-1 decode against the weights' bandwidth floor, in one run (issue 57).

The default model (SmolLM2-135M-Instruct unless `--model`) decodes one request; the
time per output token is measured as the difference between two generations of
different lengths from the same prompt (so the prompt and the first token cancel),
once per `--decode-steps` value (the engine's num_scheduler_steps). The floor is the
time one jitted pass takes to read as many bytes as the weights the batch-1 step reads
(a sum over a float32 array of that size: the device's read bandwidth), in the same
run: a decode step cannot read its weights faster. Prints ms per token, the floor, and
their ratio.

    .venv/bin/python scripts/bench_batch1.py --decode-steps 1,4,8
"""

from __future__ import annotations

import argparse
import json
import time


def weight_floor(runner, reps: int = 30) -> tuple[float, int]:
    """The seconds reading the batch-1 step's weight bytes takes at the device's read
    bandwidth (a jitted sum over a float32 array of as many bytes: one pass, no
    layout or dtype in the way), and those bytes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    weights = runner.weights_of(runner.plan.for_bucket(1))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(weights) if hasattr(x, "nbytes"))
    buf = jnp.ones(nbytes // 4, jnp.float32)
    read = jax.jit(jnp.sum)
    jax.block_until_ready(read(buf))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(read(buf))
        times.append(time.perf_counter() - t0)
    del buf
    return float(np.median(times)), nbytes


def per_token(llm, prompt: list[int], short: int, long: int, reps: int) -> float:
    """Seconds per decoded token: the best of `reps` (long - short) differences."""
    from jaxllm import SamplingParams

    def run(n):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0

    run(long)  # warm
    return min(run(long) - run(short) for _ in range(reps)) / (long - short)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--decode-steps", default="1,4,8", help="num_scheduler_steps values (comma-separated)")
    p.add_argument("--tokens", type=int, default=128, help="tokens between the short and the long generation")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    from bench_host import machine

    from jaxllm import LLM

    prompt = list(range(100, 132))
    results = {"machine": machine()}
    for k in [int(x) for x in args.decode_steps.split(",")]:
        llm = LLM(args.model, max_num_seqs=8, num_scheduler_steps=k, progress=False)
        runner = llm.llm_engine.core.runner
        floor, nbytes = weight_floor(runner)
        tok = per_token(llm, prompt, 16, 16 + args.tokens, args.reps)
        results[k] = {"ms_per_token": tok * 1e3, "floor_ms": floor * 1e3, "weight_mib": nbytes / 2**20,
                      "ratio": tok / floor}
        print(f"num_scheduler_steps={k}: {tok * 1e3:.2f} ms/token, weights {nbytes / 2**20:.0f} MiB read in "
              f"{floor * 1e3:.2f} ms, {tok / floor:.2f}x the floor", flush=True)
        del llm, runner
    print(json.dumps(results))


if __name__ == "__main__":
    main()
