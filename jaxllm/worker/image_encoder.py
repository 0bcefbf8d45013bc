"""The model runner's image side (issue 65): the encoder cache's table on the device
and the vision tower's executables that fill it.

The table holds `num_slots * tokens_per_image` embedding rows (the language model's
activation dtype), plus one slot that padding writes into. A step's images
(`SchedulerOutput.encoder_inputs`) are encoded before the step, a batch of up to
`max_images` per call, padded to a power of two (each size compiled at warm-up, or at
its first call without one), each
image's rows written at its slot; the step then reads each image token's row
(jaxllm.models.llama.ImageRows). The scheduler decides the slots
(jaxllm.core.encoder_cache_manager).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxllm.core.sched_output import EncoderInput
from jaxllm.models.params import map_declared
from jaxllm.models.vision import encode_images
from jaxllm.models.vision_params import VisionParams, declare_vision
from jaxllm.multimodal.inputs import pixel_values
from jaxllm.platform import CompileHook
from jaxllm.vision_config import VisionConfig


def encode_into(params: VisionParams, table: Float[Array, "N D"], pixels: Float[Array, "B C H W"],
                rows: Int[Array, " R"], *, cfg: VisionConfig) -> Float[Array, "N D"]:
    """`table` with the images' embeddings written at `rows` (B x tokens_per_image)."""
    embeds = encode_images(params, cfg, pixels).reshape(-1, cfg.text_hidden_size)
    return table.at[rows].set(embeds.astype(table.dtype))


class ImageEncoder:
    def __init__(self, cfg: VisionConfig, num_slots: int, max_images: int, dtype, param_dtype) -> None:
        self.cfg, self.num_slots = cfg, num_slots
        self.buckets = tuple(sorted({min(2 ** i, max_images) for i in range(max(1, max_images).bit_length() + 1)}))
        self.table = jnp.zeros(((num_slots + 1) * cfg.tokens_per_image, cfg.text_hidden_size), dtype)
        self.abstract_params = map_declared(lambda d: jax.ShapeDtypeStruct(d.shape, param_dtype), declare_vision(cfg))
        self.params: VisionParams | None = None
        self._jitted = jax.jit(functools.partial(encode_into, cfg=cfg), donate_argnums=(1,))
        self._compiled: dict[int, object] = {}
        self.num_encoded = 0
        self.while_compiling: CompileHook = contextlib.nullcontext  # as the steps'

    def warm_up(self) -> None:
        """Compile the encoder for every batch size."""
        for b in self.buckets:
            self._executable(b)

    def _executable(self, b: int):
        """The encoder compiled for batches of `b` images (now, if not yet)."""
        if b not in self._compiled:
            c, s = self.cfg.num_channels, self.cfg.image_size
            with self.while_compiling():
                self._compiled[b] = self._jitted.lower(
                    self.abstract_params, jax.ShapeDtypeStruct(self.table.shape, self.table.dtype),
                    jax.ShapeDtypeStruct((b, c, s, s), jnp.float32),
                    jax.ShapeDtypeStruct((b * self.cfg.tokens_per_image,), jnp.int32)).compile()
        return self._compiled[b]

    def encode(self, inputs: list[EncoderInput]) -> None:
        """Encode a step's images into their slots (before the step is dispatched)."""
        largest, t = self.buckets[-1], self.cfg.tokens_per_image
        for start in range(0, len(inputs), largest):
            chunk = inputs[start:start + largest]
            b = next(x for x in self.buckets if x >= len(chunk))
            pixels = np.zeros((b, self.cfg.num_channels, self.cfg.image_size, self.cfg.image_size), np.float32)
            slots = np.full(b, self.num_slots, np.int32)  # padding: the spare slot
            for i, item in enumerate(chunk):
                pixels[i], slots[i] = pixel_values(item.image), item.slot
            rows = (slots[:, None] * t + np.arange(t, dtype=np.int32)).reshape(-1)
            with jax.transfer_guard_host_to_device("allow"):
                self.table = self._executable(b)(self.params, self.table, pixels, rows)
            self.num_encoded += len(chunk)
