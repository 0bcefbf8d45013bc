"""VisionConfig: the image side of a vision-language model (issue 65), read from the
HF config of `LlavaForConditionalGeneration` (a CLIP or SigLIP vision tower, an MLP
projector, a Llama-family language model) or `Gemma3ForConditionalGeneration` (SigLIP,
average pooling, Gemma 3's projector). The language model's own config is a
ModelConfig, which holds this as its `vision` field.

A frozen dataclass, so that it is hashable and can be a static argument of jitted
functions, like ModelConfig.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# HF architecture -> the language model's model_type default (its text_config may say)
VISION_LANGUAGE_ARCHITECTURES = {
    "LlavaForConditionalGeneration": "llama",
    "Gemma3ForConditionalGeneration": "gemma3_text",
}
TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
VISION_ACTIVATIONS = ("quick_gelu", "gelu_pytorch_tanh", "gelu")


class UnsupportedVisionModelError(ValueError):
    """The checkpoint's image side is one jaxllm cannot run (the message says what)."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A vision tower (a ViT: patch embedding, bidirectional encoder layers), the
    projector into the language model's embeddings, and how images appear in prompts:
    each as `tokens_per_image` copies of `image_token_id`, replaced by its embeddings."""

    architecture: str  # of VISION_LANGUAGE_ARCHITECTURES
    tower: str  # "clip" (a class token, a LayerNorm before the layers) or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int  # the tower's layers that run: up to the layer whose output is the feature
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # of VISION_ACTIVATIONS
    projector: str  # "mlp" (LLaVA: linear, activation, linear) or "gemma3" (average pool, RMSNorm, linear)
    projector_act: str  # LLaVA's projector_hidden_act
    projector_bias: bool
    tokens_per_image: int  # image embeddings per image, each in place of one image token
    image_token_id: int
    text_hidden_size: int
    num_channels: int = 3
    post_norm: bool = False  # SigLIP as Gemma 3 reads it: the last layer's output through post_layernorm
    keep_class_token: bool = False  # LLaVA's vision_feature_select_strategy "full" (CLIP)
    # Gemma 3: an image's tokens attend to each other both ways in the language model
    # (HF's token_type_ids mask: each run of image tokens one block), the rest causally
    bidirectional_images: bool = False
    # Gemma 3: an image is written as its begin token in a prompt, and stands there as
    # begin, its image tokens, end (each between blank lines); None: LLaVA's image token
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """The tower's sequence: its patches, and CLIP's class token."""
        return self.num_patches + (self.tower == "clip")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], architecture: str, text_hidden_size: int,
                       source: str = "config.json") -> VisionConfig:
        """The image side of a vision-language `hf` config (its `vision_config` and the
        projector's fields); UnsupportedVisionModelError naming what is not supported."""
        vision = hf.get("vision_config") or {}
        tower = TOWERS.get(vision.get("model_type", ""))
        if tower is None:
            raise UnsupportedVisionModelError(f"{source}: vision tower {vision.get('model_type')!r} is not supported; "
                                              f"supported: {', '.join(TOWERS)}")
        act = vision.get("hidden_act", "quick_gelu" if tower == "clip" else "gelu_pytorch_tanh")
        if act not in VISION_ACTIVATIONS:
            raise UnsupportedVisionModelError(f"{source}: vision hidden_act {act!r} is not supported")
        try:
            layers, size, patch = int(vision["num_hidden_layers"]), int(vision["image_size"]), int(vision["patch_size"])
            common = dict(architecture=architecture, tower=tower, hidden_size=int(vision["hidden_size"]),
                          intermediate_size=int(vision["intermediate_size"]), num_heads=int(vision["num_attention_heads"]),
                          image_size=size, patch_size=patch, layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
                          hidden_act=act, num_channels=int(vision.get("num_channels", 3)),
                          text_hidden_size=text_hidden_size)
            if architecture == "LlavaForConditionalGeneration":
                return cls(**common, **_llava_fields(hf, layers, (size // patch) ** 2, tower, source))
            tokens = int(hf.get("mm_tokens_per_image", 256))
            if int(tokens ** 0.5) ** 2 != tokens or (size // patch) % int(tokens ** 0.5):
                raise UnsupportedVisionModelError(f"{source}: mm_tokens_per_image {tokens} does not pool the "
                                                  f"{size // patch}x{size // patch} patches evenly")
            return cls(**common, num_layers=layers, projector="gemma3", projector_act="", projector_bias=False,
                       tokens_per_image=tokens, image_token_id=int(hf.get("image_token_id", hf.get("image_token_index"))),
                       post_norm=True, bidirectional_images=True, boi_token_id=int(hf.get("boi_token_index", 255999)),
                       eoi_token_id=int(hf.get("eoi_token_index", 256000)))
        except KeyError as e:
            raise UnsupportedVisionModelError(f"{source}: vision_config misses {e.args[0]!r}") from None


def _llava_fields(hf: Mapping[str, Any], layers: int, patches: int, tower: str, source: str) -> dict[str, Any]:
    """LLaVA's choices: which layer's output is the feature (all layers after it never
    run), whether CLIP's class token stays, the projector's activation and bias."""
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise UnsupportedVisionModelError(f"{source}: vision_feature_layer {layer!r} (several layers) is not supported")
    used = layer if layer >= 0 else layers + 1 + layer  # hidden_states[0] is the embeddings'
    if not 0 <= used <= layers:
        raise UnsupportedVisionModelError(f"{source}: vision_feature_layer {layer} is outside the tower's {layers} layers")
    strategy = hf.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise UnsupportedVisionModelError(f"{source}: vision_feature_select_strategy {strategy!r} is not supported")
    keep = strategy == "full" or tower != "clip"  # "default" drops CLIP's class token
    return dict(num_layers=used, projector="mlp", projector_act=hf.get("projector_hidden_act", "gelu"),
                projector_bias=bool(hf.get("multimodal_projector_bias", True)),
                tokens_per_image=patches + (keep and tower == "clip"),
                image_token_id=int(hf.get("image_token_id", hf.get("image_token_index", 32000))),
                keep_class_token=keep and tower == "clip")
