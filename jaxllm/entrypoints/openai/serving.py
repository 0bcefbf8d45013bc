"""/v1/completions and /v1/chat/completions: run the requests on the engine and shape
the answers (whole JSON bodies, or server-sent events ending with `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.output_processor import RequestOutputKind
from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from jaxllm.sampling_params import SamplingParams


@dataclass
class Job:
    """One engine request of an HTTP request (a completions call can hold several)."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    choice_offset: int  # index of this job's first choice among the response's choices


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
            async for output in engine.generate(job.request_id, job.prompt_ids, params, output_kind=kind):
                queue.put_nowait((job, output))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
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

def completion_logprobs(logprobs: SampleLogprobs, token_ids: list[int], text_offset: int) -> dict:
    """The legacy completions logprobs object."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry[token_id]
        tokens.append(sampled.decoded_token or "")
        token_logprobs.append(sampled.logprob)
        # keyed by text, so tokens that decode alike collide: the sampled one wins
        alternatives = {(lp.decoded_token or ""): lp.logprob for t, lp in entry.items() if t != token_id}
        top.append(alternatives | {tokens[-1]: sampled.logprob})
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(logprobs: SampleLogprobs, token_ids: list[int], num_top: int) -> dict:
    def item(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank or 0)
        top = [item(lp) for lp in by_rank[:num_top]]
        content.append(item(entry[token_id]) | {"top_logprobs": top})
    return {"content": content}


# --------------------------------------------------------------- completions

async def completions(engine: AsyncLLM, jobs: list[Job], params: SamplingParams, *, model: str, echo: bool,
                      stream: bool, include_usage: bool) -> dict | AsyncIterator[str]:
    rid, created = new_id("cmpl"), int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}

    def text_of(job: Job) -> str:
        return job.prompt_text if job.prompt_text is not None else engine.tokenizer.decode(job.prompt_ids)

    if not stream:
        usage, choices = Usage(), []
        async for job, output in merged(engine, jobs, params, RequestOutputKind.FINAL_ONLY):
            usage.add(output, None)
            prefix = text_of(job) if echo else ""
            for c in output.outputs:
                usage.add(output, c)
                choices.append({
                    "index": job.choice_offset + c.index,
                    "text": prefix + c.text,
                    "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, c.token_ids, len(prefix)),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        choices.sort(key=lambda c: c["index"])
        return base | {"choices": choices, "usage": usage.as_dict()}

    async def events() -> AsyncIterator[str]:
        usage, echoed, offsets = Usage(), set(), {}
        try:
            async for job, output in merged(engine, jobs, params, RequestOutputKind.DELTA):
                usage.add(output, None)
                for c in output.outputs:
                    usage.add(output, c)
                    index = job.choice_offset + c.index
                    text = c.text
                    if echo and index not in echoed:
                        echoed.add(index)
                        text = text_of(job) + text
                    offset = offsets.get(index, 0)
                    offsets[index] = offset + len(text)
                    if not text and c.finish_reason is None:
                        continue
                    choice = {"index": index, "text": text, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason,
                              "logprobs": None if c.logprobs is None else completion_logprobs(
                                  c.logprobs, c.token_ids, offset + len(text) - len(c.text))}
                    yield sse(base | {"choices": [choice]})
            if include_usage:
                yield sse(base | {"choices": [], "usage": usage.as_dict()})
        except (ValueError, RuntimeError) as e:
            yield sse(stream_error(e))
        yield sse("[DONE]")

    return events()


# ---------------------------------------------------------------------- chat

async def chat(engine: AsyncLLM, job: Job, params: SamplingParams, *, model: str, stream: bool,
               include_usage: bool, num_top_logprobs: int) -> dict | AsyncIterator[str]:
    rid, created = new_id("chatcmpl"), int(time.time())

    def logprobs_of(c: CompletionOutput):
        return None if c.logprobs is None else chat_logprobs(c.logprobs, c.token_ids, num_top_logprobs)

    if not stream:
        usage, choices = Usage(), []
        async for _, output in merged(engine, [job], params, RequestOutputKind.FINAL_ONLY):
            usage.add(output, None)
            for c in output.outputs:
                usage.add(output, c)
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs_of(c), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage.as_dict()}

    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    async def events() -> AsyncIterator[str]:
        usage, started = Usage(), set()
        try:
            for i in range(params.n):
                started.add(i)
                yield sse(base | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]})
            async for _, output in merged(engine, [job], params, RequestOutputKind.DELTA):
                usage.add(output, None)
                for c in output.outputs:
                    usage.add(output, c)
                    if not c.text and c.finish_reason is None:
                        continue
                    delta = {"content": c.text} if c.text else {}
                    yield sse(base | {"choices": [{"index": c.index, "delta": delta, "logprobs": logprobs_of(c),
                                                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
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
