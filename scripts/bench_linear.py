#!/usr/bin/env python
"""The cpu dense kernel (jaxllm.models.linear, packed weights) against XLA's dot and
numpy's BLAS (the OpenBLAS its wheel ships), on SmolLM2's projection shapes, in one
process: GFLOP/s of each and the kernel's ratio to each.

    .venv/bin/python scripts/bench_linear.py               # this CPU's native build
    .venv/bin/python scripts/bench_linear.py --isa avx2    # AVX2 + FMA only: kernels built
                                                           # with -march=x86-64-v3, XLA capped
    .venv/bin/python scripts/bench_linear.py --experts 8 --weights q4_1  # a MoE projection:
                                                           # grouped kernel, float32 and quantized
                                                           # experts, against ragged_dot
    .venv/bin/python scripts/bench_linear.py --weights q4_1  # kept blocks: the kernel multiplying
                                                           # in float32 vs in bfloat16 (a bfloat16
                                                           # model), and bfloat16 panels, each
                                                           # bfloat16 by vdpbf16ps and float tiles

`--isa avx2` on an AVX-512 machine gives the register file of an AVX2-only one (it
re-runs this script with JAXLLM_CPU_MARCH=x86-64-v3, XLA_FLAGS=--xla_cpu_max_isa=AVX2
and OPENBLAS_CORETYPE=Haswell set before JAX and numpy start). Say which machine and
which build a number came from.
"""

from __future__ import annotations

import argparse
import time

from isa_build import ISAS, describe, reexec

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # SmolLM2-135M: [K, N]


def timed(fn, *args, iters: int) -> float:
    """Best of 3 mean seconds per call of fn(*args) (a jitted function, or numpy's: a
    numpy result is ready when returned)."""
    import jax  # here, not at the top: --isa re-runs the script before JAX starts

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def run(rows: list[int], iters: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models.linear import linear, pack_weight

    rng = np.random.default_rng(0)
    print(f"{'M':>5} {'K':>5} {'N':>6} {'kernel GFLOP/s':>15} {'xla GFLOP/s':>12} {'openblas':>9} "
          f"{'kernel/xla':>10} {'kernel/blas':>11}")
    for k, n in SHAPES:
        wn = rng.standard_normal((k, n), np.float32)
        w = jnp.asarray(wn)
        packed = pack_weight(w)
        kernel = jax.jit(lambda x, p: linear(x, p))
        xla = jax.jit(lambda x, w: x @ w)
        for m in rows:
            xn = rng.standard_normal((m, k), np.float32)
            x = jnp.asarray(xn)
            np.testing.assert_allclose(np.asarray(kernel(x, packed)), np.asarray(xla(x, w)), rtol=2e-4, atol=2e-3)
            flops = 2 * m * k * n
            tk, tx = timed(kernel, x, packed, iters=iters), timed(xla, x, w, iters=iters)
            tb = timed(np.matmul, xn, wn, iters=iters)
            print(f"{m:>5} {k:>5} {n:>6} {flops / tk / 1e9:>15.1f} {flops / tx / 1e9:>12.1f} "
                  f"{flops / tb / 1e9:>9.1f} {tx / tk:>10.2f} {tb / tk:>11.2f}")


def run_blocks(fmt_name: str, rows: list[int], iters: int) -> None:
    """Kept blocks of `fmt_name` through the kernel as a float32 model multiplies them
    and as a bfloat16 model does (`float_dtype`), the same matrix as bfloat16 panels
    (each bfloat16 layout by vdpbf16ps and by the float tiles, `bf16_tiles`: the same
    sums; on a build without AVX512_BF16 both are the float tiles; and by AMX's tiles
    where the CPU has them), and (formats in blocks
    of 32 inputs or a multiple) with int8 and int16 activations (`activations`: integer
    dot products), and those also in bfloat16 from the int16 dot layout (BF16_STEP: the
    bfloat16 sums, from the copy int16 reads)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import cpu_kernels
    from jaxllm.models.linear import bf16_tiles, linear, pack_weight
    from jaxllm.models.params import BF16_STEP
    from jaxllm.models.quant import activation_quantization_ready, dequantize, quantize_weight

    rng = np.random.default_rng(0)
    print(f"{fmt_name}: GFLOP/s of the kernel multiplying kept blocks in float32 / in bfloat16, "
          "bfloat16 panels of the same matrix (bfloat16 by vdpbf16ps / by the float tiles"
          f"{'' if cpu_kernels.has_bf16_dot() else ': this build has no vdpbf16ps, both are float tiles'}), "
          "and the blocks with int8 / int16 activations (blocks of 32 inputs or a multiple); bf16 xdot: "
          "the blocks in bfloat16 (vdpbf16ps) from the int16 dot layout")
    amx = cpu_kernels.has_amx()
    print(f"{'M':>5} {'K':>5} {'N':>6} {'float32':>9} {'bf16 dot':>9} {'bf16 fl':>9} {'panels dot':>11} "
          f"{'panels fl':>10} {'int8 x':>8} {'int16 x':>8} {'bf16/f32':>9} {'fl/dot':>7} {'int8x/f32':>10} "
          f"{'int16x/f32':>11} {'bf16 xdot':>10} {'xdot/int16x':>12}" + (f" {'bf16 amx':>9} {'panels amx':>11}" if amx else ""))
    kernel = jax.jit(lambda x, p: linear(x, p))
    for k, n in SHAPES:
        q = quantize_weight(rng.standard_normal((k, n), np.float32), fmt_name)
        q16 = q.replace(float_dtype="bfloat16")
        f32, bf16 = pack_weight(q), pack_weight(q16)
        panels = pack_weight(dequantize(q16))
        ready = activation_quantization_ready(q)
        xq = [pack_weight(q.replace(activations=a)) if ready else None for a in ("int8", "int16")]
        xdot = bf16_tiles(xq[1], BF16_STEP) if ready else None
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))
            np.testing.assert_array_equal(np.asarray(kernel(x, bf16)), np.asarray(kernel(x, panels)))
            np.testing.assert_array_equal(np.asarray(kernel(x, bf16)),
                                          np.asarray(kernel(x, bf16.replace(bf16_tiles="float"))))
            layouts = (f32, bf16, bf16.replace(bf16_tiles="float"), panels, panels.replace(bf16_tiles="float"))
            t = [timed(kernel, x, w, iters=iters) for w in layouts]
            if xdot is not None:
                np.testing.assert_array_equal(np.asarray(kernel(x, xdot)), np.asarray(kernel(x, bf16)))
            t += [timed(kernel, x, w, iters=iters) if w is not None else float("nan") for w in (*xq, xdot)]
            if amx:
                t += [timed(kernel, x, w.replace(bf16_tiles="amx"), iters=iters) for w in (bf16, panels)]
            g = [2 * m * k * n / s / 1e9 for s in t]
            best16 = min(t[1], t[2])
            print(f"{m:>5} {k:>5} {n:>6} {g[0]:>9.1f} {g[1]:>9.1f} {g[2]:>9.1f} {g[3]:>11.1f} {g[4]:>10.1f} "
                  f"{g[5]:>8.1f} {g[6]:>8.1f} {t[0] / best16:>9.2f} {t[1] / t[2]:>7.2f} {t[0] / t[5]:>10.2f} "
                  f"{t[0] / t[6]:>11.2f} {g[7]:>10.1f} {t[6] / t[7]:>12.2f}" + (f" {g[8]:>9.1f} {g[9]:>11.1f}" if amx else ""))


def run_experts(experts: int, fmt_name: str, rows: list[int], iters: int) -> None:
    """A mixture of experts' [E, 576, 1536] projection, the rows spread evenly over the
    experts: the grouped kernel over float32 experts and over `fmt_name`-quantized ones
    (float32 sums, and bfloat16 for a grouped format), against ragged_dot (XLA:CPU
    computes every expert for every row) on the float32 experts. Milliseconds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models.linear import grouped_linear, pack_weight
    from jaxllm.models.params import stack_experts
    from jaxllm.models.quant import dequantize, quantize_weight

    rng = np.random.default_rng(0)
    k, n = 576, 1536
    q = stack_experts([quantize_weight(rng.standard_normal((k, n), np.float32), fmt_name) for _ in range(experts)])
    floats = dequantize(q)
    layouts = {"float32 kernel": pack_weight(floats), f"{fmt_name} kernel": pack_weight(q)}
    if q.group:
        layouts[f"{fmt_name} bf16"] = pack_weight(q.replace(float_dtype="bfloat16"))
    layouts["ragged_dot"] = floats
    fn = jax.jit(grouped_linear)
    print(f"{experts} experts of [{k}, {n}], {fmt_name}: ms per call, rows spread evenly")
    print(f"{'M':>5} " + " ".join(f"{name:>16}" for name in layouts))
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        sizes = jnp.asarray(np.bincount(np.arange(m) % experts, minlength=experts), jnp.int32)
        t = [timed(fn, x, w, sizes, iters=iters) * 1e3 for w in layouts.values()]
        print(f"{m:>5} " + " ".join(f"{v:>16.2f}" for v in t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=sorted(ISAS), default="native")
    p.add_argument("--rows", default="8,32,64,128,512", help="M values (tokens in a step)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--experts", type=int, default=0, help="> 0: a MoE projection of this many experts")
    p.add_argument("--weights", default="float32",
                   help="float32 (the kernel against XLA's dot), or a grouped quantization (q4_1, q4_0, "
                        "q8_0, int4...: kept blocks in a float32 and in a bfloat16 model)")
    args = p.parse_args()
    if not reexec(args.isa):
        return
    print(describe(args.isa))
    rows = [int(r) for r in args.rows.split(",")]
    if args.experts:
        run_experts(args.experts, "int8" if args.weights == "float32" else args.weights, rows, args.iters)
    elif args.weights == "float32":
        run(rows, args.iters)
    else:
        run_blocks(args.weights, rows, args.iters)


if __name__ == "__main__":
    main()
