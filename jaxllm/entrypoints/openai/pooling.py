"""/v1/embeddings, /pooling, /score and /rerank: pooling requests on the engine and
their answers in OpenAI's, vLLM's, Jina's and Cohere's shapes.

Every input of a call is tokenized and checked before any is queued (a bad one is a 400
and nothing runs); the inputs then run as one pooling request each, batched by the
engine, and the answer lists them in input order.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

import numpy as np

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.engine.output_processor import RequestOutputKind
from jaxllm.entrypoints.scoring import cosine
from jaxllm.messages import check_prompt
from jaxllm.outputs import PoolingRequestOutput
from jaxllm.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")


def check_encoding_format(value: str) -> None:
    if value not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format: unknown {value!r}; choose float or base64")


def prepare(engine: AsyncLLM, inputs: list, params: PoolingParams, add_special_tokens: bool = True
            ) -> list[list[int]]:
    """Each input's token ids (truncated as `params` asks), checked: ValueError naming
    the field and the input before anything runs."""
    ready = engine.ready
    params.check_for_model(ready.pooler, ready.hidden_size)
    prepared = []
    for i, item in enumerate(inputs):
        _, ids = engine.input_processor.truncated(item, params, add_special_tokens)
        try:
            check_prompt(ids, vocab_size=ready.vocab_size, max_model_len=ready.max_model_len, generates=False)
        except ValueError as e:
            field, _, problem = str(e).partition(": ")
            raise ValueError(f"input: item {i}: {problem}" if len(inputs) > 1 else f"input: {problem}") from None
        prepared.append(ids)
    return prepared


async def pool(engine: AsyncLLM, request_id: str, token_ids: list[list[int]], params: PoolingParams
               ) -> list[PoolingRequestOutput]:
    """Run each input (token ids `prepare` made: truncated already) as a pooling
    request; their outputs in input order. Cancelled (a client gone), every request
    still running is aborted."""
    params = dataclasses.replace(params, truncate_prompt_tokens=None)

    async def one(i: int, ids: list[int]) -> PoolingRequestOutput:
        result = None
        async for output in engine.generate(f"{request_id}-{i}", ids, params, output_kind=RequestOutputKind.FINAL_ONLY):
            result = output
        return result

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(token_ids)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def usage(outputs: list[PoolingRequestOutput]) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def encoded(data: np.ndarray, encoding_format: str):
    """An embedding as JSON numbers, or OpenAI's base64 of its little-endian float32s."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(data, "<f4").tobytes()).decode("ascii")
    return data.tolist()


def embeddings_body(request_id: str, model: str, outputs: list[PoolingRequestOutput], encoding_format: str,
                    kind: str = "embedding") -> dict:
    """OpenAI's embeddings list (and vLLM's /pooling list: `kind` "pooling", each item's
    vector under `data`)."""
    key = "embedding" if kind == "embedding" else "data"
    data = [{"object": kind, "index": i, key: encoded(o.outputs.data, encoding_format)} for i, o in enumerate(outputs)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": usage(outputs)}


async def similarities(engine: AsyncLLM, request_id: str, first: list[str], second: list[str],
                       params: PoolingParams, second_params: PoolingParams | None = None
                       ) -> tuple[list[float], list[PoolingRequestOutput]]:
    """The cosine of each pair's embeddings (each distinct text embedded once), and the
    outputs of the texts embedded (for usage)."""
    texts = list(dict.fromkeys(first))
    others = [t for t in dict.fromkeys(second) if t not in texts or second_params is not None]
    ids = prepare(engine, texts, params) + prepare(engine, others, second_params or params)
    outputs = await pool(engine, request_id, ids, params)
    firsts = dict(zip(texts, outputs[:len(texts)], strict=True))
    seconds = dict(zip(others, outputs[len(texts):], strict=True))
    scores = [cosine(firsts[a].outputs.data, (seconds.get(b) or firsts[b]).outputs.data)
              for a, b in zip(first, second, strict=True)]
    return scores, outputs
