"""Where a prompt's images go: the text that stands for an image in a prompt (LLaVA's
"<image>", Gemma 3's "<start_of_image>") and its expansion into the image's tokens, as
the model's HF processor writes them (LlavaProcessor, Gemma3Processor), so that the
token ids are the processor's."""

from __future__ import annotations

from jaxllm.vision_config import VisionConfig


def image_placeholder(cfg: VisionConfig, tokenizer) -> str:
    """The text one image is written as in a prompt."""
    token = cfg.image_token_id if cfg.boi_token_id is None else cfg.boi_token_id
    return tokenizer.convert_ids_to_tokens(token)


def expand_images(text: str, cfg: VisionConfig, tokenizer) -> str:
    """`text` with each image placeholder replaced by that image's tokens: LLaVA's image
    token `tokens_per_image` times; Gemma 3's begin token, image tokens and end token
    between blank lines."""
    image = tokenizer.convert_ids_to_tokens(cfg.image_token_id) * cfg.tokens_per_image
    if cfg.boi_token_id is None:
        return text.replace(image_placeholder(cfg, tokenizer), image)
    boi, eoi = (tokenizer.convert_ids_to_tokens(t) for t in (cfg.boi_token_id, cfg.eoi_token_id))
    return text.replace(boi, f"\n\n{boi}{image}{eoi}\n\n")


def count_images(text: str, cfg: VisionConfig, tokenizer) -> int:
    return text.count(image_placeholder(cfg, tokenizer))
