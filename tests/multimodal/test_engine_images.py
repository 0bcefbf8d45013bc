"""Images through the engine (issue 65): LLM.generate with vLLM's {"prompt",
"multi_modal_data": {"image": ...}} gives HF transformers' greedy tokens for prompts
with one and two images in one batch, also when chunked prefill cuts through a LLaVA
image's tokens; every prompt and sampled logprob is HF's within 1e-5 for both
architectures (Gemma 3's image tokens attend both ways: its step computes an image
whole); the encoder cache encodes an image once; prefix caching never shares blocks
between different images; bad input is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from jaxllm import LLM, SamplingParams
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.loaders import load_model
from tests.support.llm import LAZY

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
    """A small engine (few step shapes, the backends given: nothing measured at start-up)."""
    return LLM(str(llava), **dict(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="1MiB",
                                  attention_backend="cpu", linear_backend="cpu", progress=False, **LAZY,
                                  limit_mm_per_prompt={"image": 2}) | options)


@pytest.fixture(scope="module")
def llm(llava) -> LLM:
    return make(llava)


@pytest.mark.parametrize("budget", [32, pytest.param(8, marks=pytest.mark.slow)],  # chunks: the logprob test
                         ids=["whole-images", "chunks-through-images"])
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
    text = InputProcessor(load_model(test_models_dir / "llama").tokenizer, eos_token_id=None, vocab_size=512,
                          max_model_len=128)  # a text model's: no multimodal processor
    with pytest.raises(ValueError, match="multi_modal_data: this model reads text only"):
        text.make_request("r", {"prompt": "hi", "multi_modal_data": {"image": a}}, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


# Gemma 3's (24 s: its own engine) in the slow run; its logits against HF's by default:
# test_vision_models.py
@pytest.mark.parametrize("name, placeholder", [("llava", "<image>"),
                                               pytest.param("gemma3_vlm", "<start_of_image>", marks=pytest.mark.slow)])
def test_logprobs_equal_hfs(vision_models_dir, llm, name, placeholder):
    """Prompt and sampled logprobs against HF's forward over the whole sequence (with the
    processor's token_type_ids: Gemma 3's images attend both ways, which a causal step
    misses by ~0.1). Steps of 32 tokens cut through LLaVA's second image; Gemma 3's
    16-token images are never split."""
    folder = vision_models_dir / name
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    pictures = images(2, seed=7)
    prompt = {"prompt": f"Two: {placeholder} and {placeholder} compare", "multi_modal_data": {"image": pictures}}
    llm = llm if name == "llava" else make(folder)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0,
                                              prompt_logprobs=0), use_tqdm=False)[0]
    inputs = processor(text=prompt["prompt"], images=pictures, return_tensors="pt")
    ids, sampled = out.prompt_token_ids, out.outputs[0].token_ids
    assert ids == inputs["input_ids"][0].tolist()
    extra = {"token_type_ids": torch.tensor([inputs["token_type_ids"][0].tolist() + [0] * len(sampled)])} \
        if "token_type_ids" in inputs else {}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + sampled]), pixel_values=inputs["pixel_values"], **extra).logits[0]
    want = torch.log_softmax(logits, -1).numpy()[np.arange(len(ids) + len(sampled) - 1), (ids + sampled)[1:]]
    got = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
    got += [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, sampled)]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_an_image_larger_than_a_step_is_refused_where_it_must_be_whole(vision_models_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens: 8 is fewer than an image's 16 tokens"):
        make(vision_models_dir / "gemma3_vlm", max_num_batched_tokens=8)
