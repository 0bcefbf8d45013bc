"""/v1/completions and /v1/chat/completions: run the requests on the engine and shape
the answers (whole JSON bodies, or server-sent events ending with `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.output_processor import RequestOutputKind
from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.tools import ToolMode, ToolStream
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from jaxllm.reasoning import ReasoningParser, ReasoningSplitter
from jaxllm.reasoning import split as split_reasoning
from jaxllm.sampling_params import SamplingParams


@dataclass
class Job:
    """One engine request of an HTTP request (a completions call can hold several)."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    choice_offset: int  # index of this job's first choice among the response's choices
    lora_request: LoRARequest | None = None  # the adapter the request's `model` named
    cache_salt: str | None = None  # prefix-cache blocks shared only within one salt
    priority: int = 0  # lower first, under --scheduling-policy priority
    images: tuple = ()  # a vision-language model's (jaxllm.messages.ImageInput), where its prompt_ids place them


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _counted: set = field(default_factory=set)

    def add(self, output: RequestOutput, completion: CompletionOutput | None) -> None:
        if output.request_id not in self._counted:
            self._counted.add(output.request_id)
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached_tokens += output.num_cached_tokens
        if completion is not None:
            self.completion_tokens += len(completion.token_ids)

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def merged(engine: AsyncLLM, jobs: list[Job], params: SamplingParams,
                 kind: RequestOutputKind) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Outputs of all jobs as they come. Leaving early (a client gone) cancels every
    job's stream, which aborts its requests in the engine."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for output in engine.generate(job.request_id, job.prompt_ids, params, output_kind=kind,
                                                lora_request=job.lora_request, cache_salt=job.cache_salt,
                                                priority=job.priority, images=job.images):
                queue.put_nowait((job, output))
        except Exception as e:
            queue.put_nowait((job, e))
        finally:
            queue.put_nowait((job, None))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------ logprobs

MIN_JSON_LOGPROB = -9999.0  # what -inf becomes in JSON (as OpenAI and vLLM send it)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_JSON_LOGPROB)


def token_text(token_id: int, lp: Logprob, as_id: bool) -> str:
    """A token as logprobs show it: its text, or (vLLM's return_tokens_as_token_ids)
    "token_id:N", which stays exact where a token's bytes are not whole characters."""
    return f"token_id:{token_id}" if as_id else (lp.decoded_token or "")


def completion_logprobs(entries: PromptLogprobs | SampleLogprobs, token_ids: list[int], num_top: int,
                        decode: Callable[[int], str], text_offset: int = 0, as_ids: bool = False) -> dict:
    """The legacy completions logprobs object over `token_ids` (an echoed prompt's
    first token has no entry: null logprob and top_logprobs, as in vLLM). top_logprobs
    holds the scored token and the alternatives ranked up to `num_top`, keyed by text
    (tokens that decode alike collide: the scored one wins), or with `as_ids` by
    "token_id:N"."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        offsets.append(text_offset)
        if entry is None:
            tokens.append(f"token_id:{token_id}" if as_ids else decode(token_id))
            token_logprobs.append(None)
            top.append(None)
        else:
            scored = entry[token_id]
            tokens.append(token_text(token_id, scored, as_ids))
            token_logprobs.append(_clamp(scored.logprob))
            alternatives = {token_text(t, lp, as_ids): _clamp(lp.logprob)
                            for t, lp in entry.items() if t != token_id and (lp.rank or 0) <= num_top}
            top.append(alternatives | {tokens[-1]: token_logprobs[-1]})
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs, num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt position (the first is null), token
    id -> logprob, rank and decoded token, for the prompt token and the top `num_top`."""
    return [None if entry is None else {
        str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for i, (t, lp) in enumerate(entry.items()) if i == 0 or (lp.rank or 0) <= num_top
    } for entry in prompt_logprobs]


def chat_logprobs(logprobs: SampleLogprobs, token_ids: list[int], num_top: int, as_ids: bool = False) -> dict:
    def item(token_id, lp):
        text = lp.decoded_token or ""
        return {"token": token_text(token_id, lp, as_ids), "logprob": _clamp(lp.logprob),
                "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        by_rank = sorted(entry.items(), key=lambda item: item[1].rank or 0)
        top = [item(t, lp) for t, lp in by_rank[:num_top]]
        content.append(item(token_id, entry[token_id]) | {"top_logprobs": top})
    return {"content": content}


# --------------------------------------------------------------- completions

@dataclass
class CompletionShape:
    """How /v1/completions turns a job's outputs into choices: echo (the prompt's text,
    and with logprobs its logprobs, before the generated part), logprobs, and vLLM's
    prompt_logprobs field."""

    engine: AsyncLLM
    echo: bool
    num_logprobs: int | None
    num_prompt_logprobs: int | None  # the user's prompt_logprobs field
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids

    def prompt_text(self, job: Job) -> str:
        return job.prompt_text if job.prompt_text is not None else self.engine.tokenizer.decode(job.prompt_ids)

    def decode_one(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def choice(self, job: Job, c: CompletionOutput, prompt_logprobs: PromptLogprobs | None, *,
               first: bool, text_offset: int = 0) -> dict:
        """A choice (or, streaming, one chunk's choice): with echo, the first one
        holds the prompt followed by what was generated so far."""
        text, token_ids, entries = c.text, c.token_ids, c.logprobs
        if self.echo and first:
            text = self.prompt_text(job) + text
            token_ids = job.prompt_ids + token_ids
            if self.num_logprobs is not None:
                entries = list(prompt_logprobs or []) + list(c.logprobs or [])
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(entries or [], token_ids, self.num_logprobs, self.decode_one, text_offset,
                                           self.tokens_as_ids)
        choice = {"index": job.choice_offset + c.index, "text": text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.num_prompt_logprobs is not None and prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs, self.num_prompt_logprobs)
        return choice

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether a choice's first output must wait for its prompt's logprobs."""
        return self.echo and self.num_logprobs is not None


async def completions(engine: AsyncLLM, request_id: str, jobs: list[Job], params: SamplingParams, *, model: str,
                      shape: CompletionShape, stream: bool, include_usage: bool) -> dict | AsyncIterator[str]:
    """The response to one HTTP request, whose id its jobs' engine ids start with."""
    rid, created = request_id, int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}

    if not stream:
        usage, choices = Usage(), []
        async for job, output in merged(engine, jobs, params, RequestOutputKind.FINAL_ONLY):
            usage.add(output, None)
            for c in output.outputs:
                usage.add(output, c)
                choices.append(shape.choice(job, c, output.prompt_logprobs, first=True))
        choices.sort(key=lambda c: c["index"])
        return base | {"choices": choices, "usage": usage.as_dict()}

    async def events() -> AsyncIterator[str]:
        stream = CompletionStream(shape)
        try:
            async for job, output in merged(engine, jobs, params, RequestOutputKind.DELTA):
                for choice in stream.feed(job, output):
                    yield sse(base | {"choices": [choice]})
            if include_usage:
                yield sse(base | {"choices": [], "usage": stream.usage.as_dict()})
        except (ValueError, RuntimeError) as e:
            yield sse(stream_error(e))
        yield sse("[DONE]")

    return events()


@dataclass
class CompletionStream:
    """Streamed completions: DELTA outputs in, one choice per chunk out. A choice's
    first chunk echoes the prompt; with echo and logprobs it waits for the prompt's
    logprobs, which only the first sample of a prompt (n > 1) computes."""

    shape: CompletionShape
    usage: Usage = field(default_factory=Usage)
    offsets: dict[int, int] = field(default_factory=dict)  # choice index -> text sent so far
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # job id -> its prompt's
    held: dict[str, list[CompletionOutput]] = field(default_factory=dict)  # job id -> waiting outputs

    def feed(self, job: Job, output: RequestOutput) -> list[dict]:
        self.usage.add(output, None)
        for c in output.outputs:
            self.usage.add(output, c)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[job.request_id] = output.prompt_logprobs
        ready = job.request_id in self.prompt_logprobs or not self.shape.needs_prompt_logprobs
        held = self.held.setdefault(job.request_id, [])
        held.extend(output.outputs)
        if not ready:
            return []
        self.held[job.request_id] = []
        return [choice for c in held if (choice := self._choice(job, c)) is not None]

    def _choice(self, job: Job, c: CompletionOutput) -> dict | None:
        index = job.choice_offset + c.index
        first = index not in self.offsets
        offset = self.offsets.get(index, 0)
        if not (first and self.shape.echo) and not c.text and not c.token_ids and c.finish_reason is None:
            return None
        choice = self.shape.choice(job, c, self.prompt_logprobs.get(job.request_id), first=first, text_offset=offset)
        logprobs = choice["logprobs"]
        self.offsets[index] = offset + (sum(map(len, logprobs["tokens"])) if logprobs else len(choice["text"]))
        choice.pop("prompt_logprobs", None)  # not streamed, as in vLLM
        return choice


# ---------------------------------------------------------------------- chat

@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking in a chat answer (jaxllm.reasoning): split from the
    content, returned as `reasoning` (vLLM's name) and `reasoning_content` (its former
    one, which clients still read) unless the request said include_reasoning false."""

    parser: ReasoningParser
    prompt_state: str  # ReasoningParser.prompt_state of the rendered prompt
    include: bool = True

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.parser, self.prompt_state)

    def fields(self, reasoning: str | None) -> dict:
        return {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning and self.include else {}


@dataclass(frozen=True)
class ChatShape:
    """How /v1/chat/completions turns outputs into choices: top logprobs (as token ids
    with vLLM's return_tokens_as_token_ids) and prompt logprobs; with `tool_mode` tool
    calls come out as `message.tool_calls` (streamed as tool-call deltas); with
    `thinking` the thinking apart from the content (streamed as reasoning deltas);
    `echo`: the last (assistant) message's content, which the answer starts with
    (vLLM's echo)."""

    num_top_logprobs: int = 0
    num_prompt_logprobs: int | None = None
    tool_mode: ToolMode | None = None
    thinking: Thinking | None = None
    echo: str = ""
    tokens_as_ids: bool = False

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished output's assistant message and finish reason: its thinking apart,
        the tool calls found in the content (the answer) alone."""
        thinking, tool_mode = self.thinking, self.tool_mode
        reasoning, content = (None, text) if thinking is None else split_reasoning(
            thinking.parser, text, thinking.prompt_state)
        if tool_mode is None:
            message = {"role": "assistant", "content": self.echo + content if self.echo else content}
        else:
            message, finish_reason = tool_mode.message(content or "", finish_reason)
            if self.echo:
                message["content"] = self.echo + (message.get("content") or "")
        return message | ({} if thinking is None else thinking.fields(reasoning)), finish_reason

    def logprobs(self, c: CompletionOutput) -> dict | None:
        return None if c.logprobs is None else chat_logprobs(c.logprobs, c.token_ids, self.num_top_logprobs,
                                                             self.tokens_as_ids)


async def chat(engine: AsyncLLM, job: Job, params: SamplingParams, *, model: str, stream: bool,
               include_usage: bool, shape: ChatShape) -> dict | AsyncIterator[str]:
    """One chat request's answer, its choices as `shape` says."""
    rid, created = job.request_id, int(time.time())  # one id end to end: engine, logs, response
    tool_mode, thinking, logprobs_of = shape.tool_mode, shape.thinking, shape.logprobs

    if not stream:
        usage, choices, prompt_logprobs = Usage(), [], None
        async for _, output in merged(engine, [job], params, RequestOutputKind.FINAL_ONLY):
            usage.add(output, None)
            prompt_logprobs = output.prompt_logprobs or prompt_logprobs
            for c in output.outputs:
                usage.add(output, c)
                message, finish_reason = shape.message(c.text, c.finish_reason)
                choices.append({"index": c.index, "message": message, "logprobs": logprobs_of(c),
                                "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        choices.sort(key=lambda c: c["index"])
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage.as_dict()}
        if shape.num_prompt_logprobs is not None and prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs, shape.num_prompt_logprobs)
        return body

    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    async def events() -> AsyncIterator[str]:
        usage, started = Usage(), set()
        tool_streams = {i: ToolStream(tool_mode) for i in range(params.n)} if tool_mode is not None else None
        splitters = {i: thinking.splitter() for i in range(params.n)} if thinking is not None else None
        try:
            for i in range(params.n):
                started.add(i)
                yield sse(base | {"choices": [{"index": i, "delta": {"role": "assistant", "content": shape.echo},
                                               "logprobs": None, "finish_reason": None}]})
            async for _, output in merged(engine, [job], params, RequestOutputKind.DELTA):
                usage.add(output, None)
                for c in output.outputs:
                    usage.add(output, c)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue  # tokens whose text is held back still carry their logprobs
                    text, reasoning = c.text, ""
                    if splitters is not None:
                        reasoning, text = splitters[c.index].feed(c.text, final=c.finish_reason is not None)
                    delta, finish_reason = ({"content": text} if text else {}), c.finish_reason
                    if tool_streams is not None:
                        delta, finish_reason = tool_streams[c.index].feed(text, c.finish_reason)
                    delta = (thinking.fields(reasoning) if thinking is not None else {}) | delta
                    if not delta and finish_reason is None and c.logprobs is None:
                        continue  # text held back (a tool call's, a marker's) or thinking not returned
                    yield sse(base | {"choices": [{"index": c.index, "delta": delta, "logprobs": logprobs_of(c),
                                                   "finish_reason": finish_reason, "stop_reason": c.stop_reason}]})
            if include_usage:
                yield sse(base | {"choices": [], "usage": usage.as_dict()})
        except (ValueError, RuntimeError) as e:
            yield sse(stream_error(e))
        yield sse("[DONE]")

    return events()


def stream_error(error: Exception) -> dict:
    """An error event inside a stream (the status line was sent already)."""
    if isinstance(error, ValueError):
        return json.loads(APIError.from_value_error(error).as_json())
    return json.loads(APIError(500, str(error)).as_json())


def tokenizer_info(tokenizer) -> dict:
    """GET /tokenizer_info, in the shape of vLLM's: the tokenizer's init arguments
    (special tokens as strings, no file paths), its class and chat template, so a
    client (lm-eval's tokenizer_backend=remote) needs no tokenizer files. Unlike vLLM,
    added_tokens_decoder keeps each token's flags, as tokenizer_config.json does, so
    the answer saved as that file loads back with transformers."""

    def plain(value):
        if hasattr(value, "content"):  # AddedToken
            return value.content
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)

    def added_token(token) -> dict:  # as tokenizer_config.json stores it, so loading it back works
        if isinstance(token, dict):
            return token
        return {name: getattr(token, name) for name in ("content", "single_word", "lstrip", "rstrip", "normalized",
                                                          "special") if hasattr(token, name)}

    kwargs = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for name in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "tokenizer_object", "is_local",
                 "local_files_only"):
        kwargs.pop(name, None)
    decoder = kwargs.pop("added_tokens_decoder", None) or {}
    info = {k: plain(v) for k, v in kwargs.items()}
    if decoder:
        info["added_tokens_decoder"] = {str(i): added_token(t) for i, t in decoder.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            info[name] = plain(value)
    info["model_max_length"] = plain(getattr(tokenizer, "model_max_length", None))
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = tokenizer.chat_template
    return info
