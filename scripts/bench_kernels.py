#!/usr/bin/env python
"""Benchmark the Pallas kernels against their jnp references.

On a GPU: times the attention kernels (``ragged_paged_attention``, Triton, and on a
Hopper ``ragged_paged_attention_mgpu``, Mosaic GPU, where it serves the dtype: decode,
mixed and prefill workloads, `--sweep` adding decodes of 64 and 256 sequences of 1k and
8k tokens) and the KV cache writes (XLA's scatter, the engine's; Triton; Mosaic GPU), the
XLA reference where it fits in memory, and
reports achieved HBM bandwidth (and TFLOP/s for prefill) against the peaks given on the
command line (defaults: H100 SXM, 3.35 TB/s and 989 dense bf16 TFLOP/s) and against the
card's copy rate measured first (a 4 GiB array copied).

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

from jaxllm.platform import targets_hopper
from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_cache,
    write_kv_cache_reference,
)
from pallas_kernels.kv_cache_write_mgpu import write_kv_cache_mgpu
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu, unsupported

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


def workloads(batch: int, ctx: int, chunk: int, sweep: bool = False) -> list[Workload]:
    swept = [Workload(f"decode {b}x{c}", [1] * b, [c] * b) for b in (64, 256) for c in (1024, 8192)
             if (b, c) != (batch, ctx)] if sweep else []
    return swept + [
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


def copy_rate_tbs(gib: float = 4.0) -> float:
    """The card's measured copy rate: bytes read and written per second copying an array."""
    x = jnp.zeros((int(gib * (1 << 30)) // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    t = timeit(copy, x, iters=10)
    return 2 * x.nbytes / t / 1e12


def kernels(model_dims, bs: int, dtype, interpret: bool, sm_scale: float) -> dict:
    """name -> jitted attention: Triton always; Mosaic GPU on a Hopper (or interpreted)
    where it serves the configuration, else its reason printed."""
    hq, hkv, d = model_dims
    out = {"triton": jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=sm_scale, interpret=interpret))}
    why = unsupported(dtype, dtype, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs)
    if why is None and (interpret or targets_hopper()):
        out["mosaic"] = jax.jit(lambda *a: ragged_paged_attention_mgpu(*a, sm_scale=sm_scale, interpret=interpret))
    else:
        print(f"mosaic gpu kernel skipped: {why or 'not a Hopper'}")
    return out


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
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also decodes of 64 and 256 sequences of 1k and 8k tokens")
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
    attns = kernels((hq, hkv, d), bs, dtype, interpret, d ** -0.5)
    ref = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=d ** -0.5))
    copy_tbs = copy_rate_tbs() if on_gpu else None
    if copy_tbs:
        print(f"measured copy rate: {copy_tbs:.2f} TB/s ({100 * copy_tbs / args.peak_bw_tbs:.0f}% of the nominal "
              f"{args.peak_bw_tbs} TB/s)")
    for w in workloads(batch, ctx, chunk, args.sweep):
        inputs = build_inputs(w, hq, hkv, d, bs, dtype, rng)
        T = inputs[0].shape[0]
        gathered_gb = T * inputs[4].shape[1] * bs * hkv * d * 4 * 2 / 1e9
        print(f"[{w.name}] T={T}")
        want = None
        if gathered_gb <= args.ref_limit_gb:
            want = ref(*[x.astype(jnp.float32) for x in inputs[:3]], *inputs[3:])
        times = {}
        for name, attn in attns.items():
            out = attn(*inputs)
            line = f"    {name}:"
            if want is not None:
                line += f" max|err| vs reference={float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))):.2e}"
            else:
                line += f" reference skipped (~{gathered_gb:.0f} GB gathered)"
            if on_gpu:
                t = times[name] = timeit(attn, *inputs, iters=args.iters)
                bw = attention_bytes(w, hq, hkv, d, dtype.itemsize) / t / 1e12
                tf = attention_flops(w, hq, d) / t / 1e12
                line += (f"  {t * 1e3:.3f} ms  {bw:.2f} TB/s ({100 * bw / args.peak_bw_tbs:.0f}% of HBM, "
                         f"{100 * bw / copy_tbs:.0f}% of the copy rate)  {tf:.1f} TFLOP/s "
                         f"({100 * tf / args.peak_tflops:.1f}% of tensor-core peak)")
            print(line)
        if len(times) == 2:
            print(f"    mosaic / triton: {times['triton'] / times['mosaic']:.2f}x faster")
        if on_gpu and want is not None:
            tr = timeit(ref, *inputs, iters=max(1, args.iters // 4))
            print(f"    xla reference: {tr * 1e3:.3f} ms")

    # KV cache write: T new tokens scattered into shuffled slots, by each write there is
    # (the engine's is XLA's scatter: jaxllm.attention.kv_cache; the kernels are candidates)
    for T in sorted({batch, 2048 if on_gpu else 2 * batch}):
        kc = jnp.zeros((T // bs + 2 + T, bs, hkv, d), dtype)
        slots = jnp.asarray(rng.permutation(np.arange(bs, kc.shape[0] * bs))[:T], jnp.int32)
        new = jax.random.normal(jax.random.PRNGKey(1), (T, hkv, d), jnp.float32).astype(dtype)
        want = write_kv_cache_reference(new, new, kc, kc, slots)
        writes = {"xla scatter": jax.jit(write_kv_cache_reference),
                  "triton": jax.jit(lambda *a: write_kv_cache(*a, interpret=interpret))}
        if interpret or targets_hopper():
            writes["mosaic"] = jax.jit(lambda *a: write_kv_cache_mgpu(*a, interpret=interpret))
        print(f"[write_kv_cache T={T}]")
        for name, wr in writes.items():
            ok = all(bool(jnp.array_equal(g[1:], w_[1:])) for g, w_ in zip(wr(new, new, kc, kc, slots), want))
            line = f"    {name}: matches reference: {ok}"
            if on_gpu:
                t = timeit(wr, new, new, kc, kc, slots, iters=args.iters)
                line += f"  {t * 1e6:.1f} us  {2 * 2 * T * hkv * d * dtype.itemsize / t / 1e9:.1f} GB/s"
            print(line)

if __name__ == "__main__":
    main()
