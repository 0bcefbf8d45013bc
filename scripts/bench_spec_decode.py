"""Speculative decoding at batch 1 (issue 22): output tokens per second with and
without n-gram drafts, on input-grounded prompts (edit or rewrite a given code block
or paragraph, so the answer copies spans of the prompt), one request at a time, the
two engines alternating prompt by prompt in one process; greedy, so both must give
the same tokens (checked). Prints the acceptance: rate, mean acceptance length
(tokens per verification), and per draft position.

    python scripts/bench_spec_decode.py                       # the embedded SmolLM2: k=7, lookup 1..3,
                                                              # 1 token for a match shorter than 3
    python scripts/bench_spec_decode.py --num-speculative-tokens 3 --prompt-lookup-min 2 \
        --short-match-tokens 0                                # vLLM's own form: k tokens on any match
    python scripts/bench_spec_decode.py --also '{"method": "ngram", "num_speculative_tokens": 3}'
                                                              # more configurations, same run
    python scripts/bench_spec_decode.py --llama-server "$(scripts/build_llama_server.sh)"
    # a draft model: the target dequantized to float32, its Q4_1 file as the draft
    python scripts/bench_spec_decode.py --quantization none --draft-model PATH/TO/SmolLM2.Q4_1.gguf
    # structured outputs: JSON extracted from the same texts under a JSON schema
    python scripts/bench_spec_decode.py --structured

With --llama-server, llama.cpp's server runs the same chat prompts (its chat template,
greedy, the same max_tokens) one at a time, without speculation and with its n-gram
lookup (`--spec-type ngram-simple`, its n-gram length the lookup's shortest and longest: the
better counts), in the same run. Throughput at 32 clients with
speculation on is `scripts/bench_serving.py --compare-speculative JSON`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from jaxllm import LLM, SamplingParams

CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    data["retries"] = int(data.get("retries", 3))
    data["timeout"] = float(data.get("timeout", 10.0))
    return data


def save_config(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
'''

PARAGRAPH = ("The museum opens at nine in the morning and closes at six in the evening. Visitors can buy "
             "tickets at the front desk or online. Children under twelve enter for free, and students pay "
             "half price. The east wing holds paintings from the eighteenth century, while the west wing "
             "shows modern sculpture. Guided tours start every hour from the main hall.")

TASKS = [
    f"Add a docstring to each function in this code. Return the whole code.\n\n```python\n{CODE}```",
    f"Rename the function load_config to read_config in this code and return the full code.\n\n```python\n{CODE}```",
    f"Add type hints to this code and return all of it.\n\n```python\n{CODE}```",
    f"Rewrite this paragraph, replacing 'museum' with 'gallery'. Keep everything else the same.\n\n{PARAGRAPH}",
    f"Correct any mistakes in this paragraph and return it in full.\n\n{PARAGRAPH}",
    f"Repeat this paragraph, then add one sentence about parking at the end.\n\n{PARAGRAPH}",
]


_STRING_LIST = {"type": "array", "items": {"type": "string"}, "minItems": 1}
STRUCTURED_TASKS = [  # (task, JSON schema): answers that copy spans of the input under a grammar
    (f"List every sentence of this paragraph as JSON.\n\n{PARAGRAPH}",
     {"type": "object", "properties": {"sentences": _STRING_LIST}, "required": ["sentences"],
      "additionalProperties": False}),
    (f"Describe each function of this code as JSON: its name, its arguments and its lines.\n\n```python\n{CODE}```",
     {"type": "object", "properties": {"functions": {"type": "array", "items": {
         "type": "object", "properties": {"name": {"type": "string"}, "arguments": _STRING_LIST,
                                          "lines": _STRING_LIST},
         "required": ["name", "arguments", "lines"], "additionalProperties": False}}},
      "required": ["functions"], "additionalProperties": False}),
    (f"Give the opening hours, the prices and what each wing shows, as JSON.\n\n{PARAGRAPH}",
     {"type": "object", "properties": {k: {"type": "string"} for k in ("opens", "closes", "tickets", "children",
                                                                          "students", "east_wing", "west_wing")},
      "required": ["opens", "closes", "tickets", "children", "students", "east_wing", "west_wing"],
      "additionalProperties": False}),
]


def chat(task: str) -> list[dict]:
    return [{"role": "user", "content": task}]


def run_jaxllm(args) -> dict:
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
            "short_match_tokens": args.short_match_tokens or None}
    if args.draft_model:
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}
    options = dict(max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, progress=False,
                   quantization=args.quantization)
    engines = {"off": LLM(args.model, **options), "ngram": LLM(args.model, speculative_config=spec, **options)}
    for i, other in enumerate(args.also):  # more configurations, alternating with the rest
        engines[f"also{i}"] = LLM(args.model, speculative_config=json.loads(other), **options)
    if args.structured:
        from jaxllm.sampling_params import StructuredOutputsParams

        tasks = [(task, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                       structured_outputs=StructuredOutputsParams(json=schema)))
                 for task, schema in STRUCTURED_TASKS]
    else:
        tasks = [(task, SamplingParams(temperature=0, max_tokens=args.max_tokens)) for task in TASKS]
    for llm in engines.values():  # warm: the first request of an engine pays its first-use costs
        for task, params in tasks:  # (and each schema its grammar's compilation)
            llm.chat([chat(task)], params, use_tqdm=False)
    before = engines["ngram"].llm_engine.core.scheduler.spec_stats
    seconds, tokens, texts = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), {k: [] for k in engines}
    for _ in range(args.rounds):
        for task, params in tasks:
            for name, llm in engines.items():
                start = time.perf_counter()
                out = llm.chat([chat(task)], params, use_tqdm=False)[0].outputs[0]
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out.token_ids)
                texts[name].append(out.token_ids)
    stats = engines["ngram"].llm_engine.core.scheduler.spec_stats
    delta = {"num_drafts": stats.num_drafts - before.num_drafts,
             "num_draft_tokens": stats.num_draft_tokens - before.num_draft_tokens,
             "num_accepted_tokens": stats.num_accepted_tokens - before.num_accepted_tokens,
             "accepted_per_pos": [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
                                  for i, a in enumerate(stats.accepted_per_pos)]}
    also = [{"config": json.loads(other), "tok_s": tokens[f"also{i}"] / seconds[f"also{i}"],
             "identical": texts[f"also{i}"] == texts["off"], "steps": _steps_by_tokens(engines[f"also{i}"])}
            for i, other in enumerate(args.also)]
    return {"tok_s": {k: tokens[k] / seconds[k] for k in ("off", "ngram")}, "tokens": tokens,
            "identical": texts["off"] == texts["ngram"], "spec": delta, "config": spec, "also": also,
            "steps": {k: _steps_by_tokens(engines[k]) for k in ("off", "ngram")}}


def _steps_by_tokens(llm) -> dict[int, tuple[int, float]]:
    """Steps run per token bucket and their mean milliseconds (warm-up included)."""
    st = llm.llm_engine.core.runner.stats
    out = {}
    for (t, s), n in sorted(st.steps_per_bucket.items()):
        count, ms = out.get(t, (0, 0.0))
        out[t] = (count + n, ms + 1e3 * st.seconds_per_bucket[(t, s)])
    return {t: (n, round(ms / n, 1)) for t, (n, ms) in out.items()}


def run_llama_server(args) -> dict:
    """Tokens per second of llama-server on the same chats, one at a time: without
    speculation and with its n-gram lookup."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_serving import LaunchedLlamaServer

    from jaxllm.loaders.default_model import model_path

    gguf = args.llama_gguf or str(model_path(None))
    results = {}
    variants = {"off": []}
    for n in sorted({args.prompt_lookup_min, args.prompt_lookup_max}):  # its lookup matches one length
        variants[f"ngram n={n}"] = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(n),
                                    "--spec-ngram-simple-size-m", str(args.num_speculative_tokens),
                                    "--spec-draft-n-max", str(args.num_speculative_tokens)]
    for name, extra in variants.items():
        with (LaunchedLlamaServer(args.llama_server, gguf, 1, ctx_per_slot=args.max_model_len, extra=extra) as server,
              httpx.Client(base_url=server.url, timeout=600) as client):
            body = lambda task: {"messages": chat(task), "max_tokens": args.max_tokens, "temperature": 0}
            client.post("/v1/chat/completions", json=body(TASKS[0]))
            seconds = tokens = 0.0
            for _ in range(args.rounds):
                for task in TASKS:
                    start = time.perf_counter()
                    r = client.post("/v1/chat/completions", json=body(task)).json()
                    seconds += time.perf_counter() - start
                    tokens += r["usage"]["completion_tokens"]
        results[name] = tokens / seconds
    results["ngram"] = max(v for k, v in results.items() if k.startswith("ngram "))  # its best
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--short-match-tokens", type=int, default=1,
                        help="a match shorter than --prompt-lookup-max proposes at most this many (0: vLLM's "
                             "behaviour, every match proposes --num-speculative-tokens)")
    parser.add_argument("--draft-model", help="draft with this model (method draft_model) instead of n-gram lookup")
    parser.add_argument("--quantization", help="the target's quantization option (e.g. none: dequantized)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--also", action="append", default=[], metavar="JSON",
                        help="another speculative_config run alongside (repeatable): its ratio to the same baseline")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: the same chats, same run")
    parser.add_argument("--llama-gguf", help="its model (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--structured", action="store_true",
                        help="JSON extracted from the texts under a JSON schema (structured outputs), jaxllm only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    result = run_jaxllm(args)
    tok_s, spec = result["tok_s"], result["spec"]
    kind = f"{len(STRUCTURED_TASKS)} JSON extractions under a schema" if args.structured else \
        f"{len(TASKS)} input-grounded chats"
    print(f"jaxllm batch 1, {kind} x {args.rounds}, greedy, max_tokens {args.max_tokens}")
    print(f"  without speculation: {tok_s['off']:.1f} output tok/s")
    print(f"  {result['config']}: {tok_s['ngram']:.1f} output tok/s = {tok_s['ngram'] / tok_s['off']:.2f}x"
          f" (tokens identical: {result['identical']})")
    print(f"  steps by tokens (count, mean ms): without {result['steps']['off']}, with {result['steps']['ngram']}")
    for other in result["also"]:
        print(f"  also {other['config']}: {other['tok_s']:.1f} output tok/s = {other['tok_s'] / tok_s['off']:.2f}x "
              f"(tokens identical: {other['identical']}); steps {other['steps']}")
    if spec["num_draft_tokens"]:
        rate = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
        mean_len = 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
        per_pos = ", ".join(f"{a / spec['num_drafts']:.2f}" for a in spec["accepted_per_pos"])
        print(f"  acceptance {rate:.1%} of {spec['num_draft_tokens']} drafts; mean acceptance length {mean_len:.2f}; "
              f"accepted per position (of verifications): {per_pos}")
    if args.llama_server and not args.structured:
        result["llama_server"] = run_llama_server(args)
        ls = result["llama_server"]
        tried = ", ".join(f"{k} {v:.1f}" for k, v in ls.items() if k.startswith("ngram "))
        print(f"  llama-server: {ls['off']:.1f} tok/s without, {ls['ngram']:.1f} with ngram-simple ({tried}; the best) "
              f"({ls['ngram'] / ls['off']:.2f}x); jaxllm/llama-server: {tok_s['off'] / ls['off']:.2f}x without, "
              f"{tok_s['ngram'] / ls['ngram']:.2f}x with")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
