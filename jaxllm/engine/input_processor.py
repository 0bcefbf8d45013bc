"""The frontend's input side: prompts (text, token ids, chat messages) and
SamplingParams (or PoolingParams) in, validated EngineCoreRequests out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jaxllm.lora.request import LoRARequest
from jaxllm.messages import EngineCoreRequest, ImageInput
from jaxllm.multimodal.inputs import MultiModalProcessor
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

Prompt = str | Sequence[int]
# A pooling request's SamplingParams: never read to sample (the scheduler finishes it with
# its pooled vector in the step that computes its prompt); one token keeps its KV need at
# the prompt's (jaxllm.core.request.Request.max_kv_tokens)
POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)  # nothing to detokenize
Message = dict[str, Any]


# apply_chat_template's own arguments, which chat_template_kwargs may not override
RENDER_ARGUMENTS = frozenset({"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt", "tools",
                              "documents", "return_dict", "return_tensors", "continue_final_message"})


class InputProcessor:
    def __init__(self, tokenizer, *, eos_token_id: int | None, vocab_size: int, max_model_len: int,
                 multimodal: MultiModalProcessor | None = None) -> None:
        """`multimodal`: a vision-language model's images (prompts with multi_modal_data)."""
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.multimodal = multimodal

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt: must be a string or a list of token ids (ints)")
        return None, ids

    def render_chat(self, messages: list[Message], *, add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
        """The conversation as the model's chat template renders it (with the tools,
        OpenAI's `[{"type": "function", "function": {...}}]`, for templates that show them;
        `chat_template_kwargs`: the template's own variables, e.g. Qwen3's enable_thinking)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages: must be a list of {'role': ..., 'content': ...} dicts")
        template = chat_template or self.tokenizer.chat_template
        if template is None:
            raise ValueError("messages: the model has no chat template; pass chat_template")
        extra = dict(chat_template_kwargs or {})
        taken = sorted(set(extra) & RENDER_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set there (the request's own fields "
                             "set them)")
        return self.tokenizer.apply_chat_template(
            [normalize_message(m) for m in messages],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **extra,
        )

    def chat_prompt(self, messages: list[Message], load_image=None, **render) -> str | dict:
        """A conversation as the prompt to generate from: its rendered text, or with image
        parts (`chat_images`) vLLM's {"prompt": text, "multi_modal_data": {"image": [...]}}.
        `render`: render_chat's options."""
        messages, images = self.chat_images(messages, load_image)
        text = self.render_chat(messages, **render)
        return {"prompt": text, "multi_modal_data": {"image": images}} if images else text

    def chat_images(self, messages: list[Message], load_image=None) -> tuple[list[Message], list]:
        """The messages with their image parts taken out, and the images in order. An
        `image_url` part is loaded by `load_image(url)` (jaxllm.multimodal.image_io), an
        `image_pil` part (offline, vLLM's) is its PIL image. Each image's placeholder
        comes first in its message's text, on a line of its own (vLLM's string content
        form). A text-only model refuses them, naming the part."""
        if not isinstance(messages, list):
            return messages, []
        out, images = [], []
        for m, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                out.append(message)
                continue
            found, texts = [], []
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "image_pil"):
                    found.append(self._part_image(part, kind, f"messages[{m}].content[{i}]", load_image))
                else:
                    texts.append(part)
            images += found
            if found:
                placeholders = "".join(self.multimodal.placeholder + "\n" for _ in found)
                texts = [{"type": "text", "text": placeholders}, *texts]
            out.append({**message, "content": texts})
        return out, images

    def _part_image(self, part: dict, kind: str, where: str, load_image):
        if self.multimodal is None:
            raise ValueError(f"{where}: a content part of type {kind!r} is not supported: this model reads text "
                             "parts only")
        if kind == "image_pil":
            return part.get("image_pil")
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if load_image is None:
            from jaxllm.multimodal.image_io import load_image_url as load_image
        try:
            return load_image(url)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def truncated(self, prompt: Prompt, params: PoolingParams, add_special_tokens: bool = True
                  ) -> tuple[str | None, list[int]]:
        """A pooling prompt's (text, token ids), its first `truncate_prompt_tokens` kept
        (-1: max_model_len): a text's by the tokenizer, which keeps its special tokens
        ([CLS] ... [SEP]; as sentence-transformers truncates), token ids as they come."""
        limit = params.truncate_prompt_tokens
        if limit is None:
            return self.tokenize(prompt, add_special_tokens)
        if limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {limit} is more than this model's maximum context length "
                             f"({self.max_model_len} tokens); use -1 for that")
        limit = self.max_model_len if limit == -1 else limit
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens, truncation=True, max_length=limit)
            return prompt, list(ids["input_ids"])
        text, ids = self.tokenize(prompt, add_special_tokens)
        return text, ids[:limit]

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams, *,
                     add_special_tokens: bool = True, cache_salt: str | None = None,
                     arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                     priority: int = 0, images: tuple[ImageInput, ...] = ()) -> tuple[EngineCoreRequest, str | None]:
        """The core's request for `prompt` (a pooling one where `params` is
        PoolingParams: it generates nothing), validated. `images`: those of token ids
        prepared already (`with_images`; the server's)."""
        pooling = params if isinstance(params, PoolingParams) else None
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            text, ids, images = self.with_images(prompt, params, add_special_tokens)
        elif pooling is not None:
            text, ids = self.truncated(prompt, pooling, add_special_tokens)
            params = POOLING_SAMPLING
        else:
            text, ids = self.tokenize(prompt, add_special_tokens)
            text, ids = self.keep_last(text, ids, params.truncate_prompt_tokens)
            if params.bad_words:
                params = params.clone(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            pooling_params=pooling,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            lora_request=lora_request,
            priority=priority,
            images=images,
        )
        request.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        return request, text

    def with_images(self, prompt: dict, params: SamplingParams | PoolingParams, add_special_tokens: bool):
        """(text, token ids, images) of a prompt with `multi_modal_data` (vLLM's
        {"prompt": ..., "multi_modal_data": {"image": PIL image or list}})."""
        if self.multimodal is None:
            raise ValueError("multi_modal_data: this model reads text only (it has no vision tower)")
        data, text = prompt["multi_modal_data"], prompt.get("prompt")
        if not isinstance(data, dict) or set(data) - {"image"}:
            kinds = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"multi_modal_data: images are the only modality this model reads, as "
                             f"{{'image': ...}}; got {kinds}")
        if not isinstance(text, str):
            raise ValueError("prompt: a prompt with multi_modal_data is text ({'prompt': str, 'multi_modal_data': "
                             "...}), where the images' placeholders stand")
        if isinstance(params, PoolingParams) or params.truncate_prompt_tokens is not None:
            raise ValueError("multi_modal_data: not with pooling or truncate_prompt_tokens (an image's tokens are "
                             "not cut)")
        ids, images = self.multimodal.process(text, data.get("image", []), add_special_tokens)
        return text, ids, images


    def keep_last(self, text: str | None, ids: list[int], limit: int | None) -> tuple[str | None, list[int]]:
        """A generation prompt's last `limit` tokens (vLLM's truncate_prompt_tokens for
        generation: the end is what the next token continues; -1: max_model_len - 1,
        room for one token); a cut text is the kept tokens' decoding."""
        if limit is None:
            return text, ids
        keep = self.max_model_len - 1 if limit == -1 else limit
        if keep >= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {limit} leaves no room to generate in this model's context "
                             f"({self.max_model_len} tokens); use at most {self.max_model_len - 1}, or -1")
        if len(ids) <= keep:
            return text, ids
        ids = ids[-keep:]
        return self.tokenizer.decode(ids), ids

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as the tokenizer spells it alone and after a space
        (both are banned; vLLM's bad_words)."""
        out: list[list[int]] = []
        for word in words:
            for spelled in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(spelled, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


def normalize_message(message: Message) -> Message:
    """A message with string content; OpenAI text parts are joined."""
    if "role" not in message:
        raise ValueError("messages: every message needs a 'role'")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") not in ("text", None):
                raise ValueError(f"messages: a content part of type {part.get('type')!r} is not supported by this "
                                 "model (it reads text parts only)")
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: content parts must be {'type': 'text', 'text': ...}")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ValueError("messages: content must be a string or a list of text parts")
    return {**message, "content": content}
