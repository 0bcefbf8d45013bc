"""Images into a vision tower's pixel values, as the model's HF image processor makes
them (CLIPImageProcessor for LLaVA, Gemma3ImageProcessor; their Pillow path): to RGB
(transparency composited onto white), resized with Pillow (the shortest edge to a size,
or to an exact size), center-cropped, rescaled to [0, 1] and normalized per channel.
The settings come from the model folder's processor_config.json ("image_processor")
or preprocessor_config.json. tests/multimodal/test_image_processor.py holds it to HF's
processor, value for value, on generated images.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """What the HF image processor does, its fields read from its config."""

    shortest_edge: int | None = None  # resize keeping the aspect ratio, the shorter side to this
    size: tuple[int, int] | None = None  # or resize to exactly (height, width)
    resample: int = Image.Resampling.BICUBIC  # a Pillow filter (HF's `resample`)
    crop: tuple[int, int] | None = None  # center crop to (height, width)
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = None  # normalize: (x - mean) / std per channel
    std: tuple[float, ...] | None = None
    convert_rgb: bool = True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "preprocessor_config.json") -> ImageProcessorConfig:
        """From an HF image processor's config; ValueError naming what is not supported."""
        if d.get("do_pan_and_scan"):
            raise ValueError(f"{source}: do_pan_and_scan (Gemma 3's crops of wide images) is not supported")
        size = d.get("size") or {}
        fields: dict[str, Any] = dict(resample=int(d.get("resample", Image.Resampling.BICUBIC)),
                                      convert_rgb=bool(d.get("do_convert_rgb", True)))
        if d.get("do_resize", True):
            if "shortest_edge" in size and "longest_edge" not in size:
                fields["shortest_edge"] = int(size["shortest_edge"])
            elif "height" in size and "width" in size:
                fields["size"] = (int(size["height"]), int(size["width"]))
            else:
                raise ValueError(f"{source}: image size {size} is not supported")
        if d.get("do_center_crop"):
            crop = d.get("crop_size") or {}
            fields["crop"] = (int(crop["height"]), int(crop["width"])) if "height" in crop else (int(crop),) * 2
        fields["rescale_factor"] = float(d.get("rescale_factor", 1 / 255)) if d.get("do_rescale", True) else None
        if d.get("do_normalize", True):
            fields.update(mean=tuple(float(x) for x in d["image_mean"]), std=tuple(float(x) for x in d["image_std"]))
        return cls(**fields)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageProcessorConfig:
        """The image processor of a model folder (FileNotFoundError if it has none)."""
        for name in PROCESSOR_FILES:
            path = Path(folder) / name
            if path.is_file():
                d = json.loads(path.read_text())
                if name == "processor_config.json":
                    if "image_processor" not in d:
                        continue
                    d = d["image_processor"]
                return cls.from_dict(d, str(path))
        raise FileNotFoundError(f"{folder}: no image processor config ({' or '.join(PROCESSOR_FILES)})")


def to_rgb(image: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8: transparency composited onto a white background, as HF does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))


def resized_shape(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) after the resize: exact, or the shorter side to `shortest_edge`
    and the longer one scaled and truncated (HF's get_resize_output_image_size)."""
    if cfg.size is not None:
        return cfg.size
    short, long = min(height, width), max(height, width)
    new_long = int(cfg.shortest_edge * long / short)
    return (new_long, cfg.shortest_edge) if width <= height else (cfg.shortest_edge, new_long)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[C, H, W] cropped around its center (zero-padded where it is smaller), as HF does."""
    h, w = pixels.shape[1:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + height, left:left + width]
    out = np.zeros((pixels.shape[0], max(h, height), max(w, width)), pixels.dtype)
    pad_top, pad_left = -(-(out.shape[1] - h) // 2), -(-(out.shape[2] - w) // 2)
    out[:, pad_top:pad_top + h, pad_left:pad_left + w] = pixels
    return center_crop(out, height, width)


def preprocess_image(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """One image's pixel values, [3, H, W] float32."""
    rgb = to_rgb(image) if cfg.convert_rgb else np.asarray(image)
    if cfg.shortest_edge is not None or cfg.size is not None:
        height, width = resized_shape(*rgb.shape[:2], cfg)
        rgb = np.asarray(Image.fromarray(rgb).resize((width, height), resample=cfg.resample))
    pixels = np.moveaxis(rgb, -1, 0)
    if cfg.crop is not None:
        pixels = center_crop(pixels, *cfg.crop)
    pixels = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32) if cfg.rescale_factor \
        else pixels.astype(np.float32)
    if cfg.mean is not None:
        mean, std = np.asarray(cfg.mean, np.float32), np.asarray(cfg.std, np.float32)
        pixels = ((pixels.T - mean) / std).T
    return pixels


def preprocess(images: Sequence[Image.Image], cfg: ImageProcessorConfig) -> np.ndarray:
    """Images of one size after preprocessing (the vision tower's): [N, 3, H, W] float32."""
    return np.stack([preprocess_image(image, cfg) for image in images])
