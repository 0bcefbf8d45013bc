#!/usr/bin/env python
"""The cpu attention kernel (jaxllm.attention.cpu) against the XLA backend
(jaxllm.attention.xla), one layer of SmolLM2-135M's shapes (9 query / 3 KV heads of 64,
blocks of 16) on the step mixes the engine runs, in one process: ms per call and ratio.

    .venv/bin/python scripts/bench_attention.py               # this CPU's native build
    .venv/bin/python scripts/bench_attention.py --isa avx2    # AVX2 + FMA only (scripts/isa_build.py)

Say which machine and which build a number came from (the first line printed).
"""

from __future__ import annotations

import argparse

from bench_linear import timed
from isa_build import ISAS, describe, reexec

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MIXES = {  # name: (decode context lengths, prefill chunks as (context, new tokens))
    "decode 64 x ~400": ([400] * 64, []),
    "decode 16 x ~400": ([400] * 16, []),
    "decode 64 x ~900": ([900] * 64, []),
    "prefill 448": ([], [(0, 448)]),
    "prefill 128 after 384": ([], [(384, 128)]),
    "32 decodes + 256 chunk": ([400] * 32, [(128, 256)]),
}


def inputs(decodes: list[int], chunks: list[tuple[int, int]], rng, kv_dtype: str = "float32",
           resident: bool = False, in_order: bool = False):
    """The kernels' arguments for a step of these decodes (context lengths, +-50) and
    prefill chunks, over blocks scattered in the pool; `resident`: every decode of equal
    length and reading the first one's blocks, which then stay in the caches (what the
    kernel costs apart from reading memory)."""
    import jax.numpy as jnp
    import numpy as np

    seqs = [(ctx + 1, 1) for ctx in decodes] + [(ctx + new, new) for ctx, new in chunks]
    kv_lens = np.array([kv + int(rng.integers(-50, 50)) * (q == 1) * (not resident) for kv, q in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    max_blocks = -(-int(kv_lens.max()) // BLOCK)
    num_blocks = int(sum(-(-kv // BLOCK) for kv in kv_lens)) + 1
    perm = np.arange(1, num_blocks)  # in order, as in a fresh server
    if not in_order:
        perm = rng.permutation(perm)  # scattered blocks, as after a while of serving
    tables = np.zeros((len(seqs), max_blocks), np.int32)
    used = 0
    for s, kv in enumerate(kv_lens):
        n = -(-int(kv) // BLOCK)
        tables[s, :n] = tables[0, :n] if resident and s > 0 and q_lens[s] == 1 else perm[used:used + n]
        used += n
    t = int(q_lens.sum())
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return (jnp.asarray(rng.standard_normal((t, HEADS, HEAD_DIM), np.float32)),
            jnp.asarray(rng.standard_normal(shape, np.float32), kv_dtype),
            jnp.asarray(rng.standard_normal(shape, np.float32), kv_dtype),
            jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
            jnp.asarray(np.int32(len(seqs))))


def run(iters: int, kv_dtype: str, resident: bool, in_order: bool = False, bf16_products: bool = False) -> None:
    import functools

    import jax
    import numpy as np

    from jaxllm.attention.cpu import ragged_paged_attention_cpu
    from jaxllm.attention.xla import ragged_paged_attention_xla

    rng = np.random.default_rng(0)
    scale = HEAD_DIM ** -0.5
    cpu = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=scale))
    xla = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=scale))
    rounded = jax.jit(functools.partial(ragged_paged_attention_cpu, sm_scale=scale, bf16_products=True))
    print(f"KV cache {kv_dtype}; cpu GB/s: the K/V rows the sequences read, per second of the cpu kernel")
    extra = f" {'bf16p ms':>9} {'cpu/bf16p':>9}" if bf16_products else ""
    print(f"{'step mix':>24} {'cpu ms':>8} {'xla ms':>8} {'xla/cpu':>8} {'cpu GB/s':>9}{extra}")
    for name, (decodes, chunks) in MIXES.items():
        args = inputs(decodes, chunks, rng, kv_dtype, resident, in_order)
        np.testing.assert_allclose(np.asarray(cpu(*args)), np.asarray(xla(*args)), rtol=1e-4, atol=1e-4)
        tc, tx = timed(cpu, *args, iters=iters), timed(xla, *args, iters=iters)
        kv_bytes = sum(int(kv) for kv in np.asarray(args[3])) * KV_HEADS * HEAD_DIM * 2 * args[1].dtype.itemsize
        extra = ""
        if bf16_products:  # a bfloat16 model's rounding: within a few bfloat16 ulps of the float path
            np.testing.assert_allclose(np.asarray(rounded(*args)), np.asarray(cpu(*args)), rtol=0, atol=5e-2)
            tb = timed(rounded, *args, iters=iters)
            extra = f" {1e3 * tb:9.2f} {tc / tb:9.2f}"
        print(f"{name:>24} {1e3 * tc:8.2f} {1e3 * tx:8.2f} {tx / tc:8.2f} {kv_bytes / tc / 1e9:9.1f}{extra}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=sorted(ISAS), default="native")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--resident", action="store_true",
                   help="the decodes read one sequence's blocks, kept in the caches: the kernel apart from memory")
    p.add_argument("--in-order", action="store_true",
                   help="each sequence's blocks in order in the pool (a fresh server) rather than scattered")
    p.add_argument("--bf16-products", action="store_true",
                   help="also time the cpu kernel as a bfloat16 model runs it (queries and probabilities "
                        "rounded to bfloat16; with --kv-cache-dtype bfloat16)")
    args = p.parse_args()
    if not reexec(args.isa):
        return
    print(describe(args.isa))
    run(args.iters, args.kv_cache_dtype, args.resident, args.in_order, args.bf16_products)


if __name__ == "__main__":
    main()
