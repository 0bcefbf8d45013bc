#!/usr/bin/env python
"""Weight quantization on a CPU (issue 19): each format against float32, in one run.

Per format (`--formats`, default none,int8,q8_0,q4_1; the first is the baseline): the
parameter bytes the engine holds,
batch-1 decode (a 64-token prompt, 128 greedy tokens), offline throughput (32 requests:
64-token prompts, 128 tokens each, all queued at once), and quality against float32:
mean and max |logprob difference| of the prompt logprobs of the reference prompts
(scripts/eval_tasks/capitals.jsonl's chats, rendered with the chat template), and the
capitals score (the expected answer as a whole word of the 16-token greedy answer:
`scripts/batch_eval.py --score`'s `is_correct`).

    .venv/bin/python scripts/bench_quant.py                 # the embedded SmolLM2
    .venv/bin/python scripts/bench_quant.py --formats none,int8 --model path/to/model

The embedded SmolLM2 is a Q4_1 GGUF: `none` dequantizes it, `q4_1` keeps its blocks
(the default), and the other formats quantize its dequantized weights, exported once
as an F32 GGUF (build/smollm2-f32.gguf; asking another format of the Q4_1 file itself
is refused, not re-quantized).
    .venv/bin/python scripts/bench_quant.py --isa avx2    # the kernels and XLA as on an AVX2-only CPU

A format may name a KV cache dtype after a slash (`q4_1/int8`: the default weights with an
int8 KV cache; `kv_cache_dtype`, default auto):
    .venv/bin/python scripts/bench_quant.py --formats q4_1,q4_1/bfloat16,q4_1/int8,q4_1/fp8

`+a8` (`+a16`, `+abf16`) after the weights multiplies them with int8 (int16, bfloat16)
activations (`activation_quantization`; int8 and int16: formats kept in blocks of 32
inputs), `+auto` with what the engine's default `auto` takes here (bfloat16 on AMX, int16
on the cpu kernel elsewhere); without it every format multiplies float activations
(`activation_quantization="none"`), so `q4_1+auto` is what the default serves:
    .venv/bin/python scripts/bench_quant.py --formats none,q4_1,q4_1+a8,q4_1+a16,q4_1+abf16

`--dtype bfloat16` runs every format as a bfloat16 model (the kept blocks multiplied in
bfloat16: each weight rounded, x rounded, float32 sums; the KV cache bfloat16 under `auto`);
`@dtype` after a format runs that one so (against a float32 first format, in one run):
    .venv/bin/python scripts/bench_quant.py --formats q4_1 --dtype bfloat16
    .venv/bin/python scripts/bench_quant.py --formats none@float32,q4_1+a16@float32,q4_1@bfloat16
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from batch_eval import is_correct
from isa_build import ISAS, describe, reexec

from jaxllm import LLM, SamplingParams

CAPITALS = Path(__file__).parent / "eval_tasks" / "capitals.jsonl"


def timed_generate(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


ACTIVATIONS = {"a8": "int8", "a16": "int16", "abf16": "bfloat16", "auto": "auto"}  # a format's "+..."
FLOAT_GGUF = Path(__file__).parent.parent / "build" / "smollm2-f32.gguf"


def source(model: str | None, fmt: str) -> tuple[str | None, str | None]:
    """The checkpoint and the quantization to load for `fmt`: `--model` as asked; the
    embedded Q4_1 file dequantized (none) or kept (q4_1), else its float export."""
    if model is not None:
        return model, fmt
    if fmt in ("none", "q4_1"):
        return None, fmt if fmt == "none" else None
    if not FLOAT_GGUF.exists():
        subprocess.run([sys.executable, str(Path(__file__).parent / "export_gguf.py"), str(FLOAT_GGUF)], check=True)
    return str(FLOAT_GGUF), fmt


def measure(model: str | None, fmt: str, items: list[dict], dtype: str = "auto") -> dict:
    fmt_only, _, own_dtype = fmt.partition("@")
    dtype = own_dtype or dtype
    weights, _, kv_cache_dtype = fmt_only.partition("/")
    weights, _, activations = weights.partition("+")
    if activations not in ("", "a8", "a16", "abf16", "auto"):
        raise SystemExit(f"{fmt}: after '+' only a8, a16, abf16 or auto (int8, int16 or bfloat16 activations, "
                         "or what auto gives here)")
    model, quantization = source(model, weights)
    llm = LLM(model, quantization=quantization, max_model_len=1024, kv_cache_dtype=kv_cache_dtype or "auto", dtype=dtype,
              activation_quantization=ACTIVATIONS.get(activations, "none"), progress=False)
    core = llm.llm_engine.core
    rng = np.random.default_rng(0)
    random_prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(100, 40000, 64)]} for _ in range(32)]
    decode = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(random_prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    s1, n1 = timed_generate(llm, random_prompts[:1], decode)
    s32, n32 = timed_generate(llm, random_prompts, decode)
    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template(it["messages"], add_generation_prompt=True, tokenize=False) for it in items]
    scored = llm.generate(chats, SamplingParams(max_tokens=16, temperature=0, prompt_logprobs=0),
                          use_tqdm=False)
    result = {
        "format": fmt, "describe": core.describe(), "weights": core.runner.describe_weights(),
        "batch1_tok_s": n1 / s1, "batch32_tok_s": n32 / s32,
        "prompt_logprobs": [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in scored],
        "correct": sum(is_correct(o.outputs[0].text, _answers(it)) for o, it in zip(scored, items)),
    }
    del llm, core
    gc.collect()
    return result


def _answers(item: dict) -> list[str]:
    expected = item.get("expected", [])
    return [expected] if isinstance(expected, str) else list(expected)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--formats", default="none,int8,q8_0,q4_1")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--isa", choices=sorted(ISAS), default="native", help="avx2: as on an AVX2-only CPU")
    p.add_argument("--dtype", default="auto", help="the model's dtype for every format without its own @dtype")
    args = p.parse_args()
    if not reexec(args.isa):
        return
    if args.out:  # made now, not after the run (a fresh clone has no bench_results/)
        args.out.parent.mkdir(parents=True, exist_ok=True)
    items = [json.loads(line) for line in CAPITALS.read_text().splitlines() if line.strip()]
    print(describe(args.isa), flush=True)
    results = [measure(args.model, q, items, args.dtype) for q in args.formats.split(",")]
    base = results[0]
    print(f"\n{'format':14s}{'batch-1 tok/s':>15s}{'x':>7s}{'32 req tok/s':>14s}{'x':>7s}"
          f"{'capitals':>10s}{'mean |dlp|':>12s}{'max |dlp|':>11s}  weights")
    for r in results:
        diffs = np.concatenate([np.abs(np.subtract(a, b)) for a, b in zip(r["prompt_logprobs"], base["prompt_logprobs"])])
        r["mean_abs_logprob_diff"], r["max_abs_logprob_diff"] = float(diffs.mean()), float(diffs.max())
        print(f"{r['format']:14s}{r['batch1_tok_s']:15.1f}{r['batch1_tok_s'] / base['batch1_tok_s']:7.2f}"
              f"{r['batch32_tok_s']:14.1f}{r['batch32_tok_s'] / base['batch32_tok_s']:7.2f}"
              f"{r['correct']:>5d}/{len(items):<4d}{r['mean_abs_logprob_diff']:12.4f}{r['max_abs_logprob_diff']:11.3f}"
              f"  {r['weights']}")
    for r in results:
        print(f"{r['format']}: {r['describe']}")
    if args.out:
        args.out.write_text(json.dumps([{k: v for k, v in r.items() if k != "prompt_logprobs"} for r in results], indent=1))


if __name__ == "__main__":
    main()
