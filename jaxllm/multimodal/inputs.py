"""A prompt's images, as the frontend prepares them for the engine core (issue 65): the
prompt's placeholders expanded into each image's tokens (jaxllm.multimodal.prompt),
the images preprocessed (jaxllm.multimodal.image_processor) and hashed by content, and
where each image's tokens are. Validation in one place: a wrong count, too many
images, something that is not an image: a ValueError naming `multi_modal_data`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from PIL import Image

from jaxllm.messages import ImageInput
from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess_image
from jaxllm.multimodal.prompt import count_images, expand_images, image_placeholder
from jaxllm.vision_config import VisionConfig


def pixel_values(image: ImageInput) -> np.ndarray:
    """An image's pixel values as an array (a view of its bytes)."""
    return np.frombuffer(image.pixels, np.float32).reshape(image.shape)


def image_hash(pixels: np.ndarray) -> str:
    """The content key of preprocessed pixel values (their shape and bytes)."""
    return hashlib.sha256(repr(pixels.shape).encode() + np.ascontiguousarray(pixels).tobytes()).hexdigest()


def image_spans(token_ids: Sequence[int], image_token_id: int, length: int) -> list[int]:
    """The first position of each run of `length` image tokens, in order; ValueError
    where a run is of another length."""
    offsets, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == image_token_id:
            j += 1
        if (j - i) % length:
            raise ValueError(f"prompt: a run of {j - i} image tokens, not a multiple of the model's {length} per image")
        offsets += range(i, j, length)
        i = j
    return offsets


class MultiModalProcessor:
    def __init__(self, vision: VisionConfig, image_processor: ImageProcessorConfig, tokenizer,
                 limit_per_prompt: int) -> None:
        self.vision, self.image_processor, self.tokenizer = vision, image_processor, tokenizer
        self.limit_per_prompt = limit_per_prompt
        self.placeholder = image_placeholder(vision, tokenizer)

    def process(self, text: str, images: Sequence, add_special_tokens: bool = True
                ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (each placeholder expanded) and its images, in order."""
        images = self.check(text, images)
        ids = self.tokenizer.encode(expand_images(text, self.vision, self.tokenizer),
                                    add_special_tokens=add_special_tokens)
        offsets = image_spans(ids, self.vision.image_token_id, self.vision.tokens_per_image)
        if len(offsets) != len(images):  # an image token typed into the text itself
            raise ValueError(f"prompt: {len(offsets)} images' tokens for {len(images)} images")
        pixels = [preprocess_image(image, self.image_processor) for image in images]
        return ids, tuple(ImageInput(image_hash(p), offset, self.vision.tokens_per_image, p.tobytes(), p.shape)
                          for p, offset in zip(pixels, offsets))

    def check(self, text: str, images: Sequence) -> list[Image.Image]:
        if isinstance(images, Image.Image):
            images = [images]
        images = list(images)
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data: image {i} is a {type(image).__name__}, not a PIL image")
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"multi_modal_data: {len(images)} images, more than the {self.limit_per_prompt} a "
                             "prompt may have (--limit-mm-per-prompt)")
        slots = count_images(text, self.vision, self.tokenizer)
        if slots != len(images):
            raise ValueError(f"multi_modal_data: {len(images)} images for {slots} image placeholders "
                             f"({self.placeholder!r}) in the prompt")
        return images
