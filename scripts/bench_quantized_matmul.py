"""Times the Pallas weight-only quantized matmuls (pallas_kernels/quantized_matmul.py,
Triton; on a Hopper also pallas_kernels/quantized_matmul_mgpu.py, Mosaic GPU, in the
engine's layout for it: values transposed, 4-bit ones two to a byte) against XLA on the same weights: a bfloat16 ``jnp.dot`` (the unquantized baseline) and
jaxllm's XLA path for the quantized weight (`linear`: dequantize, then dot), at
Llama-3.1-8B's projection shapes, bfloat16 activations, M = 1 .. 256 rows. Prints
microseconds per call, the weight bytes each path reads per microsecond (GB/s, to set
against the card's HBM bandwidth) and the kernel's speed-up over both, measured in the
same run.

    python scripts/bench_quantized_matmul.py            # on a GPU
    python scripts/bench_quantized_matmul.py --small    # anywhere (off GPU interpret mode: a smoke run, no timing)
    python scripts/bench_quantized_matmul.py --sweep --rows 1   # the kernel's tiles, K splits and pipeline depths

With `--sweep`, each shape, format and M is also timed over `SWEEP` (block_n, split_k,
num_stages) and the fastest configurations are printed beside the default:
what to set `default_blocks` from on the card the run names.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.linear import linear, mosaic_weight
from jaxllm.models.quant import quantize_weight
from jaxllm.platform import targets_hopper
from pallas_kernels.quantized_matmul import quantized_matmul
from pallas_kernels.quantized_matmul_mgpu import quantized_matmul_mgpu

SWEEP = [dict(block_n=bn, split_k=sk, num_stages=st) for bn in (64, 128, 256) for sk in (1, 2, 4, 8) for st in (2, 4)]
SHAPES = {"gate/up 4096x14336": (4096, 14336), "down 14336x4096": (14336, 4096), "o 4096x4096": (4096, 4096)}


def timed(f, *args, iters: int) -> float:
    """Microseconds per call: `iters` calls dispatched back to back (after a compiled,
    warmed one), the clock stopped when the last is done, so the host's dispatch
    overlaps the device's work as it does in a step."""
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters * 1e6


def weight_bytes(qw) -> int:
    """The bytes a weight is read as: 4-bit values held as int4 count half a byte."""
    values = qw.q.size // 2 if qw.q.dtype == jnp.int4 else qw.q.size * qw.q.dtype.itemsize
    return values + sum(a.size * a.dtype.itemsize for a in (qw.scale, qw.mins) if a is not None)


def sweep(x, qw, gpu: bool, iters: int, best: int = 3) -> str:
    """The fastest `best` of SWEEP's configurations that this shape admits, as text."""
    times = []
    for cfg in SWEEP:
        f = jax.jit(lambda x, qw, cfg=cfg: quantized_matmul(x, qw.q, qw.scale, qw.mins, group=qw.group,
                                                            interpret=not gpu, **cfg))
        try:
            times.append((timed(f, x, qw, iters=iters), cfg))
        except ValueError:  # a split that does not divide K's steps
            continue
    times.sort(key=lambda t: t[0])
    return "; ".join(f"{t:.1f} us {' '.join(f'{k}={v}' for k, v in c.items())}" for t, c in times[:best])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,q8_0,q4_1")
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="tiny shapes (for a CPU: interpret mode)")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's configurations (SWEEP)")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    shapes = {"small 256x128": (256, 128)} if args.small else SHAPES
    mosaic_here = targets_hopper() or not gpu  # interpreted off GPU
    iters = args.iters if gpu else 1
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})" + ("" if gpu else ": interpret mode"))
    print("| shape | format | M | bf16 dot us | XLA dequant us | pallas us | pallas GB/s | vs bf16 | vs XLA "
          "| mosaic us | mosaic GB/s | mosaic vs bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for label, (k, n) in shapes.items():
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        w16 = jnp.asarray(w, jnp.bfloat16)
        for fmt in args.formats.split(","):
            qw = jax.tree.map(jnp.asarray, quantize_weight(w, fmt))
            kern = jax.jit(lambda x, qw: quantized_matmul(x, qw.q, qw.scale, qw.mins, group=qw.group,
                                                          interpret=not gpu))
            held = mosaic_weight(qw.replace(kernel="pallas"), jnp.bfloat16)  # the engine's layout (4-bit: int4)
            mgpu = jax.jit(lambda x, w: quantized_matmul_mgpu(x, w.q, w.scale, w.mins, group=w.group,
                                                             interpret=not gpu))
            for m in (int(r) for r in args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
                t_dot = timed(jax.jit(jnp.dot), x, w16, iters=iters)
                t_xla = timed(jax.jit(linear), x, qw, iters=iters)
                t_k = timed(kern, x, qw, iters=iters)
                mosaic = "- | - | -"
                if mosaic_here and held.kernel == "mosaic":
                    t_m = timed(mgpu, x, held, iters=iters)
                    mosaic = f"{t_m:.1f} | {weight_bytes(held) / t_m / 1e3:.0f} | {t_dot / t_m:.2f}x"
                print(f"| {label} | {fmt} | {m} | {t_dot:.1f} | {t_xla:.1f} | {t_k:.1f} | "
                      f"{weight_bytes(qw) / t_k / 1e3:.0f} | {t_dot / t_k:.2f}x | {t_xla / t_k:.2f}x | {mosaic} |",
                      flush=True)
                if args.sweep:
                    print(f"  fastest: {sweep(x, qw, gpu, iters)}", flush=True)


if __name__ == "__main__":
    main()
