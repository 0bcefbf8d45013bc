"""Images through the engine (issue 65) on the LLaVA test model: LLM.generate with
vLLM's {"prompt", "multi_modal_data": {"image": ...}} gives HF transformers' greedy
tokens for prompts with one and two images in one batch, also when chunked prefill
cuts through an image's tokens; the encoder cache encodes an image once; prefix
caching never shares blocks between different images; bad input is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from jaxllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (30 + 7 * i, 50 - 5 * i, 3), np.uint8)) for i in range(n)]


@pytest.fixture(scope="module")
def llava(vision_models_dir):
    return vision_models_dir / "llava"


@pytest.fixture(scope="module")
def hf(llava):
    return AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval(), AutoProcessor.from_pretrained(llava)


def hf_greedy(hf, prompt: dict, n: int = 8) -> tuple[list[int], list[int]]:
    model, processor = hf
    imgs = prompt["multi_modal_data"]["image"]
    inputs = processor(text=prompt["prompt"], images=imgs if isinstance(imgs, list) else [imgs], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)[0].tolist()
    m = inputs["input_ids"].shape[1]
    return out[:m], out[m:]


def make(llava, **options) -> LLM:
    return LLM(str(llava), **dict(max_model_len=256, max_num_batched_tokens=32, kv_cache_memory="1MiB",
                                  progress=False, limit_mm_per_prompt={"image": 2}) | options)


@pytest.fixture(scope="module")
def llm(llava) -> LLM:
    return make(llava)


@pytest.mark.parametrize("budget", [32, 8], ids=["whole-images", "chunks-through-images"])
def test_greedy_tokens_equal_hfs(llava, llm, hf, budget):
    a, b, c = images(3)
    prompts = [{"prompt": "Look: <image> what is it?", "multi_modal_data": {"image": a}},
               {"prompt": "Two: <image> and <image> compare them", "multi_modal_data": {"image": [b, c]}},
               {"prompt": "No image here", "multi_modal_data": {"image": []}}]
    llm = llm if budget == 32 else make(llava, max_num_batched_tokens=budget)
    for prompt, out in zip(prompts[:2], llm.generate(prompts[:2], GREEDY, use_tqdm=False)):
        ids, tokens = hf_greedy(hf, prompt)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == tokens
    assert llm.generate(prompts[2], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate("No image here", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_encoder_cache_and_prefix_isolation(llm, hf):
    """The same text with two images: each its own answer (HF's); the first image again:
    no encoder step, its prompt served from the prefix cache."""
    a, b = images(2, seed=1)
    core = llm.llm_engine.core
    encoded, hits = core.runner.images.num_encoded, core.scheduler.encoder_cache.stats.hits
    first, other = ({"prompt": "Look: <image> what is it?", "multi_modal_data": {"image": x}} for x in (a, b))
    got = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in (first, other)]
    for prompt, out in zip((first, other), got):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)[1]
    assert got[1].num_cached_tokens < 16  # the text before the image only: no block of the first image's
    assert core.runner.images.num_encoded == encoded + 2
    again = llm.generate(first, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == got[0].outputs[0].token_ids
    assert again.num_cached_tokens >= 16 and core.runner.images.num_encoded == encoded + 2
    llm.generate({"prompt": "Now: <image> again?", "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)
    # not in the prefix cache (another text before it): from the encoder cache
    assert core.runner.images.num_encoded == encoded + 2 and core.scheduler.encoder_cache.stats.hits == hits + 1


def test_bad_input_is_refused_by_name(llm, test_models_dir):
    a = images(1)[0]
    cases = [
        ({"prompt": "<image> and <image>", "multi_modal_data": {"image": a}}, "1 images for 2 image placeholders"),
        ({"prompt": "<image><image><image>", "multi_modal_data": {"image": [a] * 3}}, "more than the 2 a prompt"),
        ({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, "image 0 is a str, not a PIL image"),
        ({"prompt": "<image>", "multi_modal_data": {"audio": a}}, "images are the only modality"),
        ({"prompt": [1, 2, 3], "multi_modal_data": {"image": a}}, "a prompt with multi_modal_data is text"),
        ("an <image> typed in", "image tokens do not stand for its 0 images"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    text = LLM(str(test_models_dir / "llama"), max_model_len=128, kv_cache_memory="1MiB", progress=False)
    with pytest.raises(ValueError, match="multi_modal_data: this model reads text only"):
        text.generate({"prompt": "hi", "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_gemma3_images_are_not_served_by_the_engine_yet(vision_models_dir):
    with pytest.raises(ValueError, match="attend to themselves both ways"):
        LLM(str(vision_models_dir / "gemma3_vlm"), max_model_len=256, kv_cache_memory="1MiB", progress=False)
