#!/usr/bin/env python
"""The cpu dense kernel (jaxllm.models.linear, packed weights) against XLA's dot, on
SmolLM2's projection shapes, in one process: GFLOP/s of each and their ratio.

    .venv/bin/python scripts/bench_linear.py               # this CPU's native build
    .venv/bin/python scripts/bench_linear.py --isa avx2    # AVX2 + FMA only: kernels built
                                                           # with -march=x86-64-v3, XLA capped

`--isa avx2` on an AVX-512 machine gives the register file of an AVX2-only one (it
re-runs this script with JAXLLM_CPU_MARCH=x86-64-v3 and XLA_FLAGS=--xla_cpu_max_isa=AVX2
set before JAX starts). Say which machine and which build a number came from.
"""

from __future__ import annotations

import argparse
import time

from isa_build import ISAS, describe, reexec

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # SmolLM2-135M: [K, N]


def timed(fn, *args, iters: int) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def run(rows: list[int], iters: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models.linear import linear, pack_weight

    rng = np.random.default_rng(0)
    print(f"{'M':>5} {'K':>5} {'N':>6} {'kernel GFLOP/s':>15} {'xla GFLOP/s':>12} {'kernel/xla':>10}")
    for k, n in SHAPES:
        w = jnp.asarray(rng.standard_normal((k, n), np.float32))
        packed = pack_weight(w)
        kernel = jax.jit(lambda x, p: linear(x, p))
        xla = jax.jit(lambda x, w: x @ w)
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            np.testing.assert_allclose(np.asarray(kernel(x, packed)), np.asarray(xla(x, w)), rtol=2e-4, atol=2e-3)
            flops = 2 * m * k * n
            tk, tx = timed(kernel, x, packed, iters=iters), timed(xla, x, w, iters=iters)
            print(f"{m:>5} {k:>5} {n:>6} {flops / tk / 1e9:>15.1f} {flops / tx / 1e9:>12.1f} {tx / tk:>10.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=sorted(ISAS), default="native")
    p.add_argument("--rows", default="8,32,64,128,512", help="M values (tokens in a step)")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not reexec(args.isa):
        return
    print(describe(args.isa))
    run([int(r) for r in args.rows.split(",")], args.iters)


if __name__ == "__main__":
    main()
