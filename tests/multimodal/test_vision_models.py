"""Vision-language models (issue 65) against HF transformers on random-weight test
models of both architectures (LLaVA: CLIP + MLP projector + Llama; Gemma 3: SigLIP +
pooling projector + Gemma 3, whose images attend both ways): the same token ids and
pixel values as the HF processor, the projected image features, the logits with one
and with two images, and greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from jaxllm.loaders import load_model
from jaxllm.models.dense import sequence_logits
from jaxllm.models.vision import encode_images
from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess
from jaxllm.multimodal.prompt import expand_images, image_placeholder

MODELS = ["llava", "gemma3_vlm"]


def pngs(tmp_path, n: int) -> list[Image.Image]:
    """`n` generated images of other sizes and modes, written as PNG and read back."""
    rng = np.random.default_rng(n)
    arrays = [rng.integers(0, 256, (40, 50, 3), np.uint8), rng.integers(0, 256, (77, 33, 4), np.uint8)]
    images = []
    for i, a in enumerate(arrays[:n]):
        Image.fromarray(a).save(tmp_path / f"{i}.png")
        images.append(Image.open(tmp_path / f"{i}.png"))
    return images


@pytest.fixture(scope="module", params=MODELS)
def models(request, vision_models_dir):
    folder = vision_models_dir / request.param
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf, AutoProcessor.from_pretrained(folder), load_model(folder, dtype="float32")


def test_image_features_equal_hfs(models):
    folder, hf, _, model = models
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        out = hf.model.get_image_features(torch.tensor(pixels))
    want = np.stack([np.asarray(f) for f in out.pooler_output])
    got = np.asarray(jax.jit(encode_images, static_argnums=1)(model.vision_params, model.config.vision, pixels))
    assert got.shape == (2, model.config.vision.tokens_per_image, model.config.hidden_size)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("num_images", [1, pytest.param(2, marks=pytest.mark.slow)])  # two: the engine's test
def test_prompt_pixels_and_logits_equal_hfs(models, tmp_path, num_images):
    """The processor's token ids and pixel values; logits within 1e-4; greedy tokens."""
    folder, hf, processor, model = models
    cfg, tok = model.config, model.tokenizer
    slot = image_placeholder(cfg.vision, tok)
    text = "Look: " + " and then ".join([slot] * num_images) + " what is it?"
    images = pngs(tmp_path, num_images)
    inputs = processor(text=text, images=images, return_tensors="pt")
    ids = tok(expand_images(text, cfg.vision, tok)).input_ids
    assert ids == inputs["input_ids"][0].tolist()
    pixels = preprocess(images, ImageProcessorConfig.from_folder(folder))
    np.testing.assert_array_equal(pixels, inputs["pixel_values"].numpy())

    embeds = encode_images(model.vision_params, cfg.vision, jnp.asarray(pixels)).reshape(1, -1, cfg.hidden_size)
    logits = jax.jit(sequence_logits, static_argnums=1)
    got = np.asarray(logits(model.params, cfg, jnp.asarray([ids]), None, embeds))[0]
    with torch.no_grad():
        want = hf(**inputs).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    with torch.no_grad():
        hf_tokens = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    mine = list(ids)
    for _ in range(6):
        mine.append(int(np.argmax(np.asarray(logits(model.params, cfg, jnp.asarray([mine]), None, embeds))[0, -1])))
    assert mine[len(ids):] == hf_tokens


def test_what_is_not_supported_is_named(vision_models_dir):
    import json

    from jaxllm.config import ModelConfig
    from jaxllm.vision_config import UnsupportedVisionModelError

    hf = json.loads((vision_models_dir / "llava" / "config.json").read_text())
    cases = [({"vision_feature_layer": [-2, -5]}, "several layers"),
             ({"vision_feature_select_strategy": "pooled"}, "vision_feature_select_strategy 'pooled'"),
             ({"vision_config": hf["vision_config"] | {"model_type": "pixtral"}}, "vision tower 'pixtral'"),
             ({"vision_feature_layer": -9}, "outside the tower's 3 layers")]
    for change, message in cases:
        with pytest.raises(UnsupportedVisionModelError, match=message):
            ModelConfig.from_hf_config(hf | change)
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.architecture, cfg.vision.num_layers, cfg.vision.tokens_per_image) == ("LlamaForCausalLM", 2, 16)
