#!/usr/bin/env python
"""Benchmark the Pallas kernels against their jnp references.

On a GPU: times ``ragged_paged_attention`` (decode, mixed and prefill workloads) and
``write_kv_cache``, the XLA reference where it fits in memory, and reports achieved
HBM bandwidth (and TFLOP/s for prefill) against the peaks given on the command line
(defaults: H100 SXM, 3.35 TB/s and 989 dense bf16 TFLOP/s).

On CPU: runs the same workloads, scaled down, in interpret mode and reports
correctness (max abs error vs the reference) only -- interpret-mode timings say
nothing about the GPU kernel.

    .venv/bin/python scripts/bench_kernels.py                 # auto: GPU if present
    .venv/bin/python scripts/bench_kernels.py --batch 64 --ctx 2048 --model llama-3.1-8b
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_cache,
    write_kv_cache_reference,
)

MODELS = {  # name: (num_q_heads, num_kv_heads, head_dim)
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.2-1b": (32, 8, 64),
    "qwen2.5-7b": (28, 4, 128),
    "tiny": (4, 2, 64),
}


@dataclasses.dataclass
class Workload:
    name: str
    q_lens: list[int]
    kv_lens: list[int]


def workloads(batch: int, ctx: int, chunk: int) -> list[Workload]:
    return [
        Workload(f"decode {batch}x{ctx}", [1] * batch, [ctx] * batch),
        Workload(f"mixed: {chunk}-token chunk @ctx {ctx // 2} + {batch - 1} decodes @{ctx}",
                 [chunk] + [1] * (batch - 1), [ctx // 2 + chunk] + [ctx] * (batch - 1)),
        Workload(f"prefill 1x{ctx}", [ctx], [ctx]),
    ]


def build_inputs(w: Workload, hq, hkv, d, bs, dtype, rng):
    S = len(w.q_lens)
    blocks = [math.ceil(k / bs) for k in w.kv_lens]
    nb = sum(blocks) + 1
    mb = max(blocks)
    perm = rng.permutation(np.arange(1, nb)).astype(np.int32)
    bt = np.zeros((S, mb), np.int32)
    i = 0
    for s, n in enumerate(blocks):
        bt[s, :n] = perm[i : i + n]
        i += n
    qsl = np.concatenate([[0], np.cumsum(w.q_lens)]).astype(np.int32)
    T = int(qsl[-1])
    key = jax.random.PRNGKey(int(rng.integers(1 << 31)))
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.uniform(k1, (T, hq, d), jnp.float32, -1, 1).astype(dtype)
    kc = jax.random.uniform(k2, (nb, bs, hkv, d), jnp.float32, -1, 1).astype(dtype)
    vc = jax.random.uniform(k3, (nb, bs, hkv, d), jnp.float32, -0.5, 0.5).astype(dtype)
    return (q, kc, vc, jnp.asarray(w.kv_lens, jnp.int32), jnp.asarray(bt), jnp.asarray(qsl),
            jnp.asarray([S], jnp.int32))


def attention_bytes(w: Workload, hq, hkv, d, itemsize) -> int:
    """HBM bytes the kernel must move: K and V of every visited position once per KV
    head, plus q in and o out (block tables and metadata are < 1%)."""
    kv = sum(w.kv_lens) * hkv * d * itemsize * 2
    qo = sum(w.q_lens) * hq * d * itemsize * 2
    return kv + qo


def attention_flops(w: Workload, hq, d) -> int:
    """Useful (causal) FLOPs: 2 matmuls x 2 FLOP per MAC over each query's visible keys."""
    total = 0
    for ql, kl in zip(w.q_lens, w.kv_lens):
        visible = sum(kl - ql + i + 1 for i in range(ql))
        total += 4 * hq * d * visible
    return total


def timeit(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--model", default=None, choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peak-bw-tbs", type=float, default=3.35, help="HBM TB/s (H100: 3.35)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 tensor-core TFLOP/s (H100 SXM: 989)")
    ap.add_argument("--ref-limit-gb", type=float, default=4.0,
                    help="skip the XLA reference when its gathered K/V would exceed this")
    args = ap.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    model = args.model or ("llama-3.1-8b" if on_gpu else "tiny")
    batch = args.batch or (64 if on_gpu else 4)
    ctx = args.ctx or (2048 if on_gpu else 40)
    chunk = args.chunk or (512 if on_gpu else 8)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    hq, hkv, d = MODELS[model]
    bs = args.block_size
    interpret = not on_gpu
    print(f"backend={jax.default_backend()} model={model} (Hq={hq}, Hkv={hkv}, D={d}) "
          f"dtype={dtype.name} block_size={bs} interpret={interpret}")
    if interpret:
        print("CPU: interpret mode, correctness only (timings are meaningless here)")

    rng = np.random.default_rng(0)
    attn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=d ** -0.5,
                                                     interpret=interpret))
    ref = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=d ** -0.5))
    for w in workloads(batch, ctx, chunk):
        inputs = build_inputs(w, hq, hkv, d, bs, dtype, rng)
        T = inputs[0].shape[0]
        gathered_gb = T * inputs[4].shape[1] * bs * hkv * d * 4 * 2 / 1e9
        out = attn(*inputs)
        line = f"[{w.name}] T={T}"
        if gathered_gb <= args.ref_limit_gb:
            f32 = [x.astype(jnp.float32) for x in inputs[:3]]
            want = ref(*f32, *inputs[3:])
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
            line += f" max|err| vs reference={err:.2e}"
        else:
            line += f" reference skipped (~{gathered_gb:.0f} GB gathered)"
        if on_gpu:
            t = timeit(attn, *inputs, iters=args.iters)
            nbytes = attention_bytes(w, hq, hkv, d, dtype.itemsize)
            flops = attention_flops(w, hq, d)
            bw = nbytes / t / 1e12
            tf = flops / t / 1e12
            line += (f"\n    pallas: {t * 1e3:.3f} ms  {bw:.2f} TB/s "
                     f"({100 * bw / args.peak_bw_tbs:.0f}% of HBM)  {tf:.1f} TFLOP/s "
                     f"({100 * tf / args.peak_tflops:.1f}% of tensor-core peak)")
            if gathered_gb <= args.ref_limit_gb:
                tr = timeit(ref, *inputs, iters=max(1, args.iters // 4))
                line += f"\n    xla reference: {tr * 1e3:.3f} ms ({tr / t:.1f}x the kernel)"
        print(line)

    # KV cache write: T new tokens scattered into shuffled slots.
    T = batch
    kc = jnp.zeros((T // bs + 2 + T, bs, hkv, d), dtype)
    slots = jnp.asarray(rng.permutation(np.arange(bs, kc.shape[0] * bs))[:T], jnp.int32)
    new = jax.random.normal(jax.random.PRNGKey(1), (T, hkv, d), jnp.float32).astype(dtype)
    wr = jax.jit(lambda *a: write_kv_cache(*a, interpret=interpret))
    got = wr(new, new, kc, kc, slots)
    want = write_kv_cache_reference(new, new, kc, kc, slots)
    ok = all(bool(jnp.array_equal(g[1:], w_[1:])) for g, w_ in zip(got, want))
    line = f"[write_kv_cache T={T}] matches reference: {ok}"
    if on_gpu:
        t = timeit(wr, new, new, kc, kc, slots, iters=args.iters)
        nbytes = 2 * 2 * T * hkv * d * dtype.itemsize
        line += f"\n    pallas: {t * 1e6:.1f} us  {nbytes / t / 1e9:.1f} GB/s"
    print(line)


if __name__ == "__main__":
    main()
