#!/usr/bin/env python
"""Beam search: jaxllm against vLLM's CPU build and HF transformers, one run (issue 60).

The same work for each, one after the other: the standard dataset's first 32 prompts
(token ids) at beam width 4, 64 new tokens each (EOS ignored, so every system runs all
64 steps), SmolLM2-135M-Instruct in float32 (equal precision: jaxllm `--dtype float32
--quantization none --activation-quantization none`; the HF folder `build/smollm2-hf`
for vLLM and transformers):

- jaxllm `LLM.beam_search` (beams forked in the engine, max_num_seqs 128: all 32 groups);
- vLLM CPU `LLM.beam_search` from its own venv (scripts/build_vllm_cpu.sh; each step
  resubmits every beam as a one-token request; max_num_seqs 128); where it will not
  install, this says why and goes on without it;
- transformers `generate(num_beams=4)` on the 32 prompts, left-padded, in batches of
  `--hf-batch`.

Each is timed after a warm-up call (jaxllm and vLLM compile at start-up, not timed).
Then correctness on the real model: real text prompts at widths 1, 2, 4 and 8 with EOS,
jaxllm's sequences against transformers' one prompt at a time (no padding): same
tokens, same order, cum_logprob against transformers' logits (`check_correctness`).

    python scripts/bench_beam_search.py --out bench_results/beam_search
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench_eval import export_hf_folder
from bench_serving import standard_dataset
from bench_vllm import vllm_env, vllm_python
from isa_build import describe

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are", "To make a cup of tea, first"]

VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM
from vllm.inputs import TokensPrompt
from vllm.sampling_params import BeamSearchParams
args = json.loads(sys.argv[1])
llm = LLM(model=args["folder"], dtype="float32", max_model_len=2048, max_num_seqs=args["max_num_seqs"])
prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
params = BeamSearchParams(beam_width=args["width"], max_tokens=args["max_tokens"], ignore_eos=True)
llm.beam_search(prompts[:2], BeamSearchParams(beam_width=args["width"], max_tokens=4, ignore_eos=True))
start = time.perf_counter()
out = llm.beam_search(prompts, params)
seconds = time.perf_counter() - start
print("RESULT", json.dumps({"seconds": seconds, "sequences": [[s.tokens for s in o.sequences] for o in out]}))
"""


def run_jaxllm(prompts: list[list[int]], width: int, max_tokens: int, max_num_seqs: int):
    from jaxllm import LLM
    from jaxllm.sampling_params import BeamSearchParams

    llm = LLM(dtype="float32", quantization="none", activation_quantization="none", max_num_seqs=max_num_seqs,
              progress=False)
    ids = [{"prompt_token_ids": p} for p in prompts]
    llm.beam_search(ids[:2], BeamSearchParams(width, 4, ignore_eos=True))
    start = time.perf_counter()
    out = llm.beam_search(ids, BeamSearchParams(width, max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    return llm, seconds, [[s.output_token_ids for s in o.sequences] for o in out]


def run_hf(folder: Path, prompts: list[list[int]], width: int, max_tokens: int, batch: int):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # EOS ignored, as the others are told

    def generate(chunk: list[list[int]], new: int) -> list[list[list[int]]]:
        longest = max(map(len, chunk))
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, num_beams=width, num_return_sequences=width,
                                 do_sample=False, max_new_tokens=new, pad_token_id=0)
        seqs = out[:, longest:].tolist()
        return [seqs[i * width:(i + 1) * width] for i in range(len(chunk))]

    generate(prompts[:2], 4)
    start = time.perf_counter()
    sequences = [s for i in range(0, len(prompts), batch) for s in generate(prompts[i:i + batch], max_tokens)]
    return model, time.perf_counter() - start, sequences


def run_vllm(python: str, folder: Path, prompts: list[list[int]], width: int, max_tokens: int, max_num_seqs: int,
             log: Path):
    args = json.dumps({"folder": str(folder), "prompts": prompts, "width": width, "max_tokens": max_tokens,
                       "max_num_seqs": max_num_seqs})
    proc = subprocess.run([python, "-c", VLLM_SCRIPT, args], capture_output=True, text=True, env=vllm_env())
    log.write_text(proc.stdout + proc.stderr)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"vLLM's beam search failed (see {log})", flush=True)
        return None
    result = json.loads(line[7:])
    return result["seconds"], [[s[len(p):] for s in seqs] for p, seqs in zip(prompts, result["sequences"])]


def check_correctness(llm, hf_model, tokenizer, max_tokens: int) -> dict:
    """jaxllm's beams against transformers' (one prompt at a time) on real text; the
    cum_logprob against transformers' logits of each sequence, their log_softmax taken
    in float64 (torch's float32 log_softmax over the 49152 entries reads ~7e-6 high per
    token: reported beside)."""
    import torch

    from jaxllm.sampling_params import BeamSearchParams

    eos = llm.llm_engine.input_processor.eos_token_id
    same = total = 0
    worst = worst_f32 = 0.0
    for width in (1, 2, 4, 8):
        outs = llm.beam_search(TEXTS, BeamSearchParams(width, max_tokens))
        for text, out in zip(TEXTS, outs):
            prompt = tokenizer.encode(text)
            g = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                  do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=0)
            want = []
            for seq in g[:, len(prompt):].tolist():
                seq = seq[:seq.index(eos) + 1] if eos in seq else seq
                with torch.no_grad():
                    logits = hf_model(torch.tensor([prompt + seq])).logits[0]
                rows = [(len(prompt) - 1 + i, t) for i, t in enumerate(seq)]
                want.append((seq, *(float(sum(lp[r, t] for r, t in rows))
                                    for lp in (logits.double().log_softmax(-1), logits.log_softmax(-1)))))
            total += 1
            if [s.output_token_ids for s in out.sequences] == [w[0] for w in want]:
                same += 1
                worst = max(worst, max(abs(s.cum_logprob - w[1]) for s, w in zip(out.sequences, want)))
                worst_f32 = max(worst_f32, max(abs(s.cum_logprob - w[2]) for s, w in zip(out.sequences, want)))
            else:
                print(f"  width {width} {text!r}: differs", flush=True)
    return {"prompts_x_widths": total, "same_sequences": same, "max_cum_logprob_diff": worst,
            "max_cum_logprob_diff_torch_float32_log_softmax": worst_f32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--vllm-venv", default=str(ROOT / "build" / "vllm-cpu"))
    p.add_argument("--hf-folder", type=Path, default=ROOT / "build" / "smollm2-hf")
    p.add_argument("--skip", action="append", default=[], choices=["vllm", "hf", "correctness"])
    p.add_argument("--out", default="bench_results/beam_search", help="prefix of the JSON file and logs")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(describe("native"), flush=True)
    folder = export_hf_folder(args.hf_folder, None)
    prompts = [r.prompt for r in standard_dataset()[:args.num_prompts]]
    results: dict = {"build": describe("native"), "workload": vars(args) | {"hf_folder": str(args.hf_folder)},
                     "runs": {}}
    work = (args.width, args.max_tokens)

    llm, seconds, mine = run_jaxllm(prompts, *work, args.max_num_seqs)
    results["runs"]["jaxllm"] = {"seconds": seconds}
    print(f"jaxllm: {seconds:.1f} s", flush=True)
    hf_model = None
    if "hf" not in args.skip:
        hf_model, seconds, theirs = run_hf(folder, prompts, *work, args.hf_batch)
        results["runs"]["transformers"] = {"seconds": seconds, "same_as_jaxllm": agreement(mine, theirs)}
        print(f"transformers: {seconds:.1f} s", flush=True)
    python = None if "vllm" in args.skip else vllm_python(args.vllm_venv)
    if python is not None:
        got = run_vllm(python, folder, prompts, *work, args.max_num_seqs, out.with_name(out.name + "_vllm.log"))
        if got is not None:
            results["runs"]["vLLM CPU"] = {"seconds": got[0], "same_as_jaxllm": agreement(mine, got[1])}
            print(f"vLLM CPU: {got[0]:.1f} s", flush=True)
    if "correctness" not in args.skip:
        if hf_model is None:
            import torch
            import transformers
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        results["correctness"] = check_correctness(llm, hf_model, llm.get_tokenizer(), 24)
    print_table(results, args)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print("wrote", out.with_suffix(".json"))


def agreement(mine: list[list[list[int]]], theirs: list[list[list[int]]]) -> float:
    """Prompts whose sequences (all of them, in order) are the same."""
    return sum(a == b for a, b in zip(mine, theirs)) / len(mine)


def print_table(results: dict, args) -> None:
    runs = results["runs"]
    base = runs["jaxllm"]["seconds"]
    tokens = args.num_prompts * args.width * args.max_tokens
    print(f"\nbeam width {args.width}, {args.num_prompts} prompts, {args.max_tokens} new tokens, float32")
    print(f"{'system':<14} {'seconds':>8} {'returned tok/s':>15} {'jaxllm is':>10} {'same beams':>11}")
    for name, run in runs.items():
        same = run.get("same_as_jaxllm")
        print(f"{name:<14} {run['seconds']:>8.1f} {tokens / run['seconds']:>15.0f} "
              f"{run['seconds'] / base:>9.2f}x {'' if same is None else f'{same:.0%}':>11}")
    c = results.get("correctness")
    if c:
        print(f"real-model correctness vs transformers: {c['same_sequences']}/{c['prompts_x_widths']} prompt x width "
              f"the same, cum_logprob within {c['max_cum_logprob_diff']:.1e} of its logits' float64 log_softmax "
              f"({c['max_cum_logprob_diff_torch_float32_log_softmax']:.1e} of torch's float32 one)")


if __name__ == "__main__":
    sys.exit(main())
