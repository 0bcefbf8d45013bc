"""The frontend's input side: prompts (text, token ids, chat messages) and
SamplingParams (or PoolingParams) in, validated EngineCoreRequests out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jaxllm.lora.request import LoRARequest
from jaxllm.messages import EngineCoreRequest
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
    def __init__(self, tokenizer, *, eos_token_id: int | None, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

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
                     priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """The core's request for `prompt` (a pooling one where `params` is
        PoolingParams: it generates nothing), validated."""
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
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
        )
        request.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        return request, text


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
