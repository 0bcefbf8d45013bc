"""Structured outputs (issue 21), measured on the embedded SmolLM2, in one run:

1. The grammar backends side by side (llguidance, which jaxllm uses; xgrammar where it is
   installed: `pip install --no-deps xgrammar apache-tvm-ffi`, it needs torch): tokenizer
   set-up, compiling 100 varied JSON schemas, and filling a 64-row token bitmask along a
   walk through each schema's grammar.
2. The engine: time to first token for a schema it has not seen vs the same schema
   again (compiled matcher cached); the core's bitmask fill at 64 constrained rows.
3. Serving: 32 clients, half of them with a `json_schema` response_format, against the
   same requests unconstrained (output tok/s ratio; target >= 0.9x).

    python scripts/bench_structured.py [--out bench_results/structured.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def random_schema(rng: random.Random) -> dict:
    """A JSON schema of 1-4 properties: strings with length bounds, integers and numbers
    with bounds (numbers in steps of 0.25), booleans, enums, string patterns, arrays
    with min/max items, nested objects (depth <= 2); some properties required. Every
    part is bounded, so a valid output is finite. (The tests' schemas too.)"""
    def leaf(depth):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "pattern", "array", "object"][
            : 8 if depth < 2 else 6])
        if kind == "string":
            return {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(4, 20)}
        if kind == "integer":
            low = rng.randint(-100, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
        if kind == "number":
            return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100]), "multipleOf": 0.25}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", "cat"], rng.randint(2, 4))}
        if kind == "pattern":
            return {"type": "string", "pattern": rng.choice(["^[A-Z]{3}$", "^[0-9]{3}-[0-9]{4}$",
                                                             "^[a-z]{1,8}@[a-z]{1,8}\\.com$"])}
        if kind == "array":
            low = rng.randint(0, 2)
            return {"type": "array", "items": leaf(depth + 1), "minItems": low, "maxItems": low + rng.randint(1, 3)}
        return obj(depth + 1)

    def obj(depth):
        names = rng.sample(["name", "age", "city", "score", "tags", "active", "id", "color", "size", "email"],
                           rng.randint(1, 4))
        return {"type": "object", "properties": {n: leaf(depth) for n in names},
                "required": rng.sample(names, rng.randint(1, len(names))), "additionalProperties": False}

    return obj(0)


def schemas(n: int = 100, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]


# ---------------------------------------------------------------- 1. backends

def bench_llguidance(tokenizer, vocab: int, specs: list[dict], rows: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    t = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    matchers = [llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(s), log_level=0)
                for s in specs]
    compile_s = time.perf_counter() - t
    walk = [m.deep_copy() for m in matchers[:rows]]
    mask = llguidance.numpy.allocate_token_bitmask(rows, vocab)
    executor = llguidance.LLExecutor()
    fills = []
    for _ in range(steps):
        t = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(walk)], mask)
        fills.append(time.perf_counter() - t)
        for i, m in enumerate(walk):
            if not m.is_stopped():
                m.consume_token(first_allowed(mask[i]))
    return {"tokenizer_setup_s": setup, "compile_100_schemas_s": compile_s,
            "fill_64_rows_ms_median": 1e3 * statistics.median(fills), "fill_64_rows_ms_max": 1e3 * max(fills)}


def first_allowed(words) -> int:
    """The lowest token id a bitmask row allows (a deterministic walk through a grammar)."""
    import numpy as np

    w = np.asarray(words).view(np.uint32)
    j = int(np.flatnonzero(w)[0])
    return j * 32 + (int(w[j]) & -int(w[j])).bit_length() - 1


def bench_xgrammar(tokenizer, vocab: int, specs: list[dict], rows: int, steps: int) -> dict | str:
    try:
        import xgrammar as xgr
    except ImportError as e:
        return f"not installed ({e})"
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    compiled = [compiler.compile_json_schema(json.dumps(s)) for s in specs]
    compile_s = time.perf_counter() - t
    walk = [xgr.GrammarMatcher(c) for c in compiled[:rows]]
    mask = xgr.allocate_token_bitmask(rows, vocab)
    fills = []
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(walk):
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)
        fills.append(time.perf_counter() - t)
        for i, m in enumerate(walk):
            if not m.is_terminated():
                m.accept_token(first_allowed(mask[i].numpy()))
    return {"tokenizer_setup_s": setup, "compile_100_schemas_s": compile_s,
            "fill_64_rows_ms_median": 1e3 * statistics.median(fills), "fill_64_rows_ms_max": 1e3 * max(fills)}


# ---------------------------------------------------------------- 2. engine

def bench_engine(specs: list[dict]) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams

    llm = LLM(max_model_len=1024, progress=False)
    msg = [{"role": "user", "content": "Give me a JSON object."}]

    def ttft(schema) -> float:
        p = SamplingParams(temperature=0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
        t = time.perf_counter()
        llm.chat(msg, p, use_tqdm=False)
        return time.perf_counter() - t

    llm.chat(msg, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # tokenizer's llguidance form
    ttft(specs[-1])
    plain_t = time.perf_counter()
    llm.chat(msg, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    plain = time.perf_counter() - plain_t
    new = [ttft(s) for s in specs[:10]]
    cached = [ttft(s) for s in specs[:10]]
    manager = llm.llm_engine.core.structured_outputs
    from jaxllm.structured_output.manager import GuidanceGrammar

    grammars = [GuidanceGrammar(manager.matcher_for(
        StructuredOutputsParams(json=s).grammar_text()), None) for s in (specs * 2)[:64]]
    rows = [(i, g, []) for i, g in enumerate(grammars)]
    fills = []
    for _ in range(20):
        t = time.perf_counter()
        bits = manager.bitmask(rows, len(rows))
        fills.append(time.perf_counter() - t)
        for i, (_, g, _) in enumerate(rows):
            if not g.matcher.is_stopped():
                g.accept_token(first_allowed(bits[i]))
    return {"ttft_unconstrained_s": plain, "ttft_new_schema_s_median": statistics.median(new),
            "ttft_cached_schema_s_median": statistics.median(cached),
            "core_bitmask_64_rows_ms_median": 1e3 * statistics.median(fills)}


# ---------------------------------------------------------------- 3. serving

async def serve_load(url: str, specs: list[dict], constrained: bool, clients: int, num: int, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    queue = list(range(num))
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop()
            schema = specs[i % len(specs)]
            extra = {}
            if constrained and i % 2:
                extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            r = await client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": f"Describe item {i} as JSON with "
                                              f"{', '.join(schema['properties'])}."}],
                max_tokens=max_tokens, temperature=0.7, seed=i, **extra)
            tokens += r.usage.completion_tokens

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    seconds = time.perf_counter() - t
    await client.close()
    return tokens, seconds


def bench_serving(specs: list[dict], clients: int, num: int, max_tokens: int) -> dict:
    from bench_serving import LaunchedServer

    with LaunchedServer("--max-model-len 1024 --served-model-name x") as server:
        asyncio.run(serve_load(server.url, specs, True, clients, clients, 8))  # warm: grammars, tokenizer form
        result = {}
        for name, constrained in (("unconstrained", False), ("half_json_schema", True), ("unconstrained_again", False)):
            tokens, seconds = asyncio.run(serve_load(server.url, specs, constrained, clients, num, max_tokens))
            result[name] = {"completion_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds}
    base = (result["unconstrained"]["tok_per_s"] + result["unconstrained_again"]["tok_per_s"]) / 2
    result["ratio_half_json_to_unconstrained"] = result["half_json_schema"]["tok_per_s"] / base
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--skip-serving", action="store_true")
    args = p.parse_args()
    from isa_build import describe

    from jaxllm.loaders import load_model

    specs = schemas()
    model = load_model(None)
    vocab = model.config.vocab_size
    result = {"machine": describe("native"),
              "backends": {"llguidance": bench_llguidance(model.tokenizer, vocab, specs, 64, 40),
                           "xgrammar": bench_xgrammar(model.tokenizer, vocab, specs, 64, 40)}}
    print(json.dumps(result, indent=1), flush=True)
    result["engine"] = bench_engine(specs)
    print(json.dumps(result["engine"], indent=1), flush=True)
    if not args.skip_serving:
        result["serving"] = bench_serving(specs, args.clients, args.num_requests, args.max_tokens)
        print(json.dumps(result["serving"], indent=1), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
