"""The image processor (issue 65) equals the models' HF image processors value for
value on generated PNGs (RGB, RGBA composited onto white, grayscale, palette, smaller
than the model's size, either orientation), and refuses what it does not do."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess

MODES = {"RGB": 3, "RGBA": 4, "L": None}


def generated(tmp_path) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    images = []
    for i, (mode, (h, w)) in enumerate([("RGB", (40, 50)), ("RGB", (77, 33)), ("RGBA", (45, 45)), ("L", (20, 60)),
                                         ("P", (30, 31)), ("RGB", (12, 10))]):
        shape = (h, w) if mode in ("L", "P") else (h, w, MODES[mode])
        image = Image.fromarray(rng.integers(0, 256, shape, np.uint8), "L" if mode == "P" else mode)
        (image.convert("P") if mode == "P" else image).save(tmp_path / f"{i}.png")
        images.append(Image.open(tmp_path / f"{i}.png"))
    return images


@pytest.mark.parametrize("name", ["llava", "gemma3_vlm"])
def test_equals_hfs_processor(vision_models_dir, tmp_path, name):
    folder = vision_models_dir / name
    hf = AutoProcessor.from_pretrained(folder).image_processor
    cfg = ImageProcessorConfig.from_folder(folder)
    for image in generated(tmp_path):
        want = hf(images=[image], return_tensors="np")["pixel_values"]
        np.testing.assert_array_equal(preprocess([image], cfg), want, err_msg=f"{image.mode} {image.size}")


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        ImageProcessorConfig.from_dict({"do_pan_and_scan": True, "size": {"height": 8, "width": 8}})
    with pytest.raises(ValueError, match="image size"):
        ImageProcessorConfig.from_dict({"size": {"longest_edge": 8}, "image_mean": [0] * 3, "image_std": [1] * 3})
    with pytest.raises(FileNotFoundError, match="no image processor config"):
        ImageProcessorConfig.from_folder(tmp_path)
