"""Images in (issue 65), timed in one run against their baselines, on the LLaVA test
model (built here) or a given LLaVA folder:

- time to first token (a request of one token) of a prompt with a new image, of the
  same image again after other text (the encoder cache serves it: no encoder step; the
  prefix cache cannot, the text before it differs), and of a text-only prompt of the
  same token count;
- a batch of requests each with its own image (max_num_seqs at once) against text-only
  requests of the same token count: output tokens per second, and the encoder's share
  of the engine's time (the vision tower's calls, waited for).

    python scripts/bench_images.py
    python scripts/bench_images.py --model path/to/llava --requests 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_test_model


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 64, 3), np.uint8))


def one_token(llm, prompt, params) -> float:
    start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    return time.perf_counter() - start


def text_like(llm, prompt: dict) -> list[int]:
    """Token ids of the prompt's length without images (its image tokens as text tokens)."""
    ids = llm.llm_engine.input_processor.make_request("probe", prompt, params_of(1))[0].prompt_token_ids
    image = llm.llm_engine.core.model.config.vision.image_token_id
    return [t if t != image else 300 + i % 50 for i, t in enumerate(ids)]


def params_of(max_tokens: int):
    from jaxllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def first_token(llm, repeat: int) -> dict:
    """Median seconds to a first token: a new image, the same image after other text, text only."""
    rows = {"new image": [], "seen image, other text before it": [], "text only, same length": []}
    for i in range(repeat):
        image = picture(1000 + i)
        new = {"prompt": f"Round {i}: <image> what is it?", "multi_modal_data": {"image": image}}
        seen = {"prompt": f"Again {i}, other words: <image> what is it?", "multi_modal_data": {"image": image}}
        rows["new image"].append(one_token(llm, new, params_of(1)))
        rows["seen image, other text before it"].append(one_token(llm, seen, params_of(1)))
        rows["text only, same length"].append(one_token(llm, {"prompt_token_ids": text_like(llm, new)}, params_of(1)))
    return {k: float(np.median(v)) for k, v in rows.items()}


def batch(llm, n: int, max_tokens: int) -> dict:
    """Output tokens per second of `n` requests each with its own image, and of text-only
    ones of the same token count; the encoder's share of the image run."""
    images = llm.llm_engine.core.runner.images
    spent = [0.0]
    encode = images.encode

    def timed_encode(inputs):
        start = time.perf_counter()
        encode(inputs)
        jax.block_until_ready(images.table)
        spent[0] += time.perf_counter() - start

    images.encode = timed_encode
    prompts = [{"prompt": f"Picture {i}: <image> describe it.", "multi_modal_data": {"image": picture(i)}}
               for i in range(n)]
    texts = [{"prompt_token_ids": text_like(llm, p)} for p in prompts]
    out = {}
    for name, batch_prompts in (("one image each", prompts), ("text only", texts)):
        spent[0] = 0.0
        start = time.perf_counter()
        llm.generate(batch_prompts, params_of(max_tokens), use_tqdm=False)
        seconds = time.perf_counter() - start
        out[name] = (n * max_tokens / seconds, spent[0] / seconds)
    images.encode = encode
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a LLaVA folder (default: the test model, built here)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    from jaxllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_test_model.write_vision_language_model(Path(tmp), "llava"))
        llm = LLM(model, max_num_seqs=args.max_num_seqs, max_model_len=256, progress=False)
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": picture(0)}}, params_of(2), use_tqdm=False)
        ttft = first_token(llm, args.repeat)
        base = ttft["text only, same length"]
        print(f"time to first token (median of {args.repeat}):")
        for name, seconds in ttft.items():
            print(f"  {name:34s} {seconds * 1e3:7.1f} ms  {seconds / base:5.2f}x text only")
        print(f"{args.requests} requests, {args.max_tokens} tokens each, {args.max_num_seqs} at once:")
        for name, (rate, share) in batch(llm, args.requests, args.max_tokens).items():
            print(f"  {name:34s} {rate:7.1f} output tok/s" + (f"  encoder {share:.1%} of the time" if share else ""))


if __name__ == "__main__":
    main()
