"""Benchmark of the host-side KV cache manager (jaxllm.core.kv_cache_manager).

Two measurements, both timing only the manager's own calls (the simulated model and
the driver's bookkeeping are outside the timed regions):

1. Throughput: a long run of mixed operations, as a scheduler issues them: admit a
   request (prefix-cache lookup + allocate its prompt + cache its full blocks), decode
   one token (allocate_slots + cache_blocks), free a request. Prompts share a few long
   prefixes, so lookups hit, and the pool is small enough to evict. Prints operations
   (manager calls) per second, with prefix caching on and off (off, the same pool
   holds far fewer requests, so most admissions fail and preempt).
2. Per engine step: N running requests each decode one token per step; a step is
   allocate_slots(request, 1) for all of them, then cache_blocks after the "model".
   Prints mean / p50 / p99 / max milliseconds per step, in wall-clock time and in the
   thread's CPU time (on a loaded machine wall-clock outliers are mostly the OS
   preempting the process). Target: < 1 ms for 256 requests.

Usage: python scripts/bench_kv_cache_manager.py [--ops 1000000] [--requests 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request


def make_prompts(rng: random.Random, num_prefixes: int, vocab: int = 32000) -> list[list[int]]:
    """Shared prompt prefixes of 128 to 512 tokens."""
    return [[rng.randrange(vocab) for _ in range(rng.randrange(128, 513))] for _ in range(num_prefixes)]


def new_request(rng: random.Random, request_id: str, prefixes: list[list[int]], vocab: int = 32000) -> Request:
    prefix = rng.choice(prefixes)
    suffix = [rng.randrange(vocab) for _ in range(rng.randrange(0, 257))]
    return Request(request_id=request_id, prompt_token_ids=prefix + suffix)


def bench_mixed_ops(num_ops: int, block_size: int, num_blocks: int, enable_caching: bool, seed: int = 0) -> None:
    rng = random.Random(seed)
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
    prefixes = make_prompts(rng, num_prefixes=8)
    running: list[Request] = []
    clock = time.perf_counter
    elapsed = 0.0
    ops = admitted = failed = 0
    next_id = 0

    target = 256  # running requests the mix hovers around
    while ops < num_ops:
        if len(running) < target * 0.8:
            op = "admit"
        elif len(running) > target * 1.2:
            op = "free"
        else:
            choice = rng.random()
            op = "decode" if choice < 0.85 else "admit" if choice < 0.93 else "free"
        if op == "decode":
            # Decode one token of a random running request (free it if the pool is full).
            request = running[rng.randrange(len(running))]
            t0 = clock()
            new_blocks = manager.allocate_slots(request, 1)
            elapsed += clock() - t0
            ops += 1
            if new_blocks is None:
                t0 = clock()
                manager.free(request)
                elapsed += clock() - t0
                ops += 1
                running.remove(request)
                failed += 1
                continue
            request.num_computed_tokens += 1
            request.append_output_token_ids(rng.randrange(32000))
            t0 = clock()
            manager.cache_blocks(request, request.num_computed_tokens)
            elapsed += clock() - t0
            ops += 1
        elif op == "admit":
            # Admit a new request: lookup + allocate the prompt + cache its blocks.
            request = new_request(rng, f"r{next_id}", prefixes)
            next_id += 1
            manager.check_fits(request)
            t0 = clock()
            hits = manager.longest_cache_hit(request)  # the whole-block lookup
            num_hit_tokens = len(hits) * manager.block_size
            new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits)
            elapsed += clock() - t0
            ops += 2
            if new_blocks is None:
                assert running, "a request that passed check_fits must fit an empty pool"
                failed += 1
                victim = running.pop(0)  # preempt the oldest request
                t0 = clock()
                manager.free(victim)
                elapsed += clock() - t0
                ops += 1
                continue
            admitted += 1
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(rng.randrange(32000))
            t0 = clock()
            manager.cache_blocks(request, request.num_computed_tokens)
            elapsed += clock() - t0
            ops += 1
            running.append(request)
        else:
            # Finish a random request.
            request = running.pop(rng.randrange(len(running)))
            t0 = clock()
            manager.free(request)
            elapsed += clock() - t0
            ops += 1

    stats = manager.prefix_cache_stats
    print(
        f"mixed ops (prefix caching {'on' if enable_caching else 'off'}): {ops:,} manager calls in "
        f"{elapsed:.2f} s = {ops / elapsed:,.0f} ops/s ({elapsed / ops * 1e6:.2f} us/op); "
        f"{admitted:,} requests admitted, {failed:,} allocations failed, "
        f"prefix-cache hit rate {stats.hit_rate:.1%}, {len(manager.block_pool.cached_block_hash_to_block):,} "
        f"cached blocks at the end"
    )


def bench_decode_steps(
    num_requests: int, num_steps: int, block_size: int, enable_caching: bool, seed: int = 0
) -> None:
    rng = random.Random(seed)
    prefixes = make_prompts(rng, num_prefixes=8)
    requests = [new_request(rng, f"r{i}", prefixes) for i in range(num_requests)]
    max_len = max(r.num_tokens for r in requests) + num_steps + 1
    num_blocks = num_requests * (-(-max_len // block_size)) + 1
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
    for request in requests:
        hits = manager.longest_cache_hit(request)
        num_hit_tokens = len(hits) * manager.block_size
        assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits) is not None
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(rng.randrange(32000))
        manager.cache_blocks(request, request.num_computed_tokens)

    sampled = [rng.randrange(32000) for _ in range(num_steps)]
    wall, cpu = time.perf_counter, time.thread_time
    wall_ms: list[float] = []
    cpu_ms: list[float] = []
    allocate_slots, cache_blocks = manager.allocate_slots, manager.cache_blocks
    for step in range(num_steps):
        w0, c0 = wall(), cpu()
        for request in requests:
            if allocate_slots(request, 1) is None:
                raise RuntimeError("pool too small for the decode benchmark")
        w1, c1 = wall(), cpu()
        for request in requests:  # the "model" and the scheduler's token bookkeeping
            request.num_computed_tokens += 1
            request.output_token_ids.append(sampled[step])
        w2, c2 = wall(), cpu()
        for request in requests:
            cache_blocks(request, request.num_computed_tokens)
        w3, c3 = wall(), cpu()
        wall_ms.append(((w1 - w0) + (w3 - w2)) * 1e3)
        cpu_ms.append(((c1 - c0) + (c3 - c2)) * 1e3)

    print(
        f"decode steps (prefix caching {'on' if enable_caching else 'off'}, {num_requests} running requests, "
        f"block_size {block_size}, {num_steps} steps), ms per step:\n"
        f"  wall: {summarize(wall_ms)}\n"
        f"  cpu:  {summarize(cpu_ms)}"
    )


def summarize(values: list[float]) -> str:
    """mean / p50 / p99 / max of ``values``."""
    ordered = sorted(values)
    p50, p99 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)]
    return f"mean {statistics.fmean(ordered):.3f}, p50 {p50:.3f}, p99 {p99:.3f}, max {ordered[-1]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=1_000_000, help="manager calls in the mixed run")
    parser.add_argument("--requests", type=int, default=256, help="running requests in the decode-step run")
    parser.add_argument("--steps", type=int, default=2000, help="decode steps to time")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=3_000, help="pool size of the mixed run")
    args = parser.parse_args()

    for enable_caching in (True, False):
        bench_mixed_ops(args.ops, args.block_size, args.num_blocks, enable_caching)
    for enable_caching in (True, False):
        bench_decode_steps(args.requests, args.steps, args.block_size, enable_caching)


if __name__ == "__main__":
    main()
