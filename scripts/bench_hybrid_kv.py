"""How many long requests a fixed KV cache admits at once, with and without the hybrid
KV cache manager (jaxllm.core.hybrid_kv_cache_manager): the engine's own cache plan
(jaxllm.engine.core.plan_cache), KV cache manager and scheduler, driven with every
step's sampled token made up, so no model runs and the counts are exact.

    python scripts/bench_hybrid_kv.py                       # Gemma 3 270M (its GGUF's config)
    python scripts/bench_hybrid_kv.py --memory 2GiB --tokens 8192 --requests 48

Prints, per manager: how many requests of that length the pool holds at their peak
(vLLM's "maximum concurrency": blocks / the blocks one request holds at most), then the
simulated run: the most requests running at once, steps to finish all, preemptions.
With `--run-model` the same requests also run through LLM both ways (greedy), timed:

    python scripts/bench_hybrid_kv.py --run-model --memory 256MiB --tokens 4096 --requests 8 --output-tokens 64 The config is read from the real Gemma 3 270M GGUF
(`gemma-3-270m`, the PyPI package) or from any model path given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm.attention.kv_cache import kv_cache_format
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.core import make_kv_cache_manager, plan_cache
from jaxllm.loaders.default_model import model_path
from jaxllm.loaders.gguf_loader import GGUFFile
from jaxllm.messages import ModelRunnerOutput
from jaxllm.sampling_params import SamplingParams


def prompts(cfg, args) -> list[list[int]]:
    """Distinct prompts (no prefix sharing) of `tokens - output_tokens + 1` ids."""
    prompt_len = args.tokens - args.output_tokens + 1
    vocab = min(cfg.vocab_size, 50000)
    return [[(i * 7919 + j) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(args.requests)]


def run(cfg, args, disable: bool) -> dict:
    config = EngineConfig(model="unused", kv_cache_memory=args.memory, max_model_len=args.tokens,
                          max_num_seqs=args.requests, max_num_batched_tokens=args.chunk, block_size=args.block_size,
                          disable_hybrid_kv_cache_manager=disable, kv_cache_dtype=args.kv_cache_dtype)
    cache = plan_cache(config, cfg, kv_cache_format(config.kv_cache_dtype, "float32"))
    scheduler = Scheduler(make_kv_cache_manager(config, cache), max_num_seqs=args.requests,
                          max_num_batched_tokens=args.chunk, max_model_len=args.tokens)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts(cfg, args)):
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                      max_tokens=args.output_tokens))
    most = steps = 0
    while scheduler.has_unfinished_requests():
        sched = scheduler.schedule()
        most = max(most, len(scheduler.running))
        rows = list(sched.num_scheduled_tokens)
        sampled = [1 if scheduler.requests[r].samples_this_step else None for r in rows]
        scheduler.update_from_output(sched, ModelRunnerOutput(rows, sampled))
        steps += 1
    return {"concurrency": cache.max_concurrency(), "layout": cache.describe(), "most running": most,
            "steps": steps, "preemptions": scheduler.num_preemptions}


def run_model(cfg, args, disable: bool) -> dict:
    """The same requests through LLM, greedy: wall time, preemptions, the tokens."""
    from jaxllm import LLM

    llm = LLM(args.model, kv_cache_memory=args.memory, max_model_len=args.tokens, max_num_seqs=args.requests,
              max_num_batched_tokens=args.chunk, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
              disable_hybrid_kv_cache_manager=disable, progress=False)
    llm.generate([{"prompt_token_ids": [2, 3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(cfg, args)], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    total = sum(len(p) for p in prompts(cfg, args)) + args.requests * args.output_tokens
    return {"seconds": seconds, "output tok/s": args.requests * args.output_tokens / seconds,
            "total tok/s": total / seconds, "preemptions": llm.llm_engine.core.scheduler.num_preemptions,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", help="a GGUF path or name (its config only is read)")
    parser.add_argument("--memory", default="2GiB", help="kv_cache_memory")
    parser.add_argument("--kv-cache-dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request (prompt + output)")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--run-model", action="store_true",
                        help="also run the requests through the model, both ways, and time them (greedy)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    cfg = GGUFFile(model_path(args.model)).model_config()
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, args.tokens))
    print(f"{cfg.architecture}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads of {cfg.head_dim}; "
          f"{args.requests} requests of {args.tokens} tokens ({args.output_tokens} generated), "
          f"kv_cache_memory {args.memory} ({args.kv_cache_dtype}), chunks of {args.chunk}, blocks of {args.block_size}")
    results = {name: run(cfg, args, disable) for name, disable in (("every block", True), ("hybrid", False))}
    for name, r in results.items():
        print(f"{name:>12}: holds {r['concurrency']:.1f} requests of {args.tokens} tokens at their peak; ran "
              f"{r['most running']} at once, {r['steps']} steps, {r['preemptions']} preemptions; KV cache {r['layout']}")
    hybrid, every = results["hybrid"], results["every block"]
    print(f"hybrid / every block: {hybrid['concurrency'] / every['concurrency']:.2f}x the requests held, "
          f"{hybrid['most running'] / every['most running']:.2f}x run at once, "
          f"{every['steps'] / hybrid['steps']:.2f}x fewer steps")
    if args.run_model:
        timed = {name: run_model(cfg, args, disable) for name, disable in (("every block", True), ("hybrid", False))}
        for name, r in timed.items():
            print(f"{name:>12}: {r['seconds']:.1f} s, {r['output tok/s']:.1f} output tok/s "
                  f"({r['total tok/s']:.0f} total), {r['preemptions']} preemptions")
        print(f"hybrid / every block: {timed['every block']['seconds'] / timed['hybrid']['seconds']:.2f}x faster; "
              f"tokens identical: {timed['hybrid']['tokens'] == timed['every block']['tokens']}")
        for name, r in timed.items():
            results[name]["run"] = {k: v for k, v in r.items() if k != "tokens"}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
