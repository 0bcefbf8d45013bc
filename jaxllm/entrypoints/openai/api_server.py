"""The Starlette app of the OpenAI-compatible server.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses (and GET / DELETE
/v1/responses/{id}: a generating server), /v1/embeddings,
/pooling, /score and /v1/score, /rerank, /v1/rerank and /v2/rerank (a pooling server:
`--runner pooling`), /tokenize, /detokenize, /v1/load_lora_adapter,
/v1/unload_lora_adapter; GET /v1/models, /tokenizer_info, /health, /version, /metrics. A request's `model` names the base model or a LoRA
adapter loaded (at start-up: --lora-modules; at run time: /v1/load_lora_adapter).
With an API key, every /v1 and /v2 route, /pooling, /score, /rerank, /tokenize,
/detokenize and /tokenizer_info need `Authorization: Bearer <key>`; /health, /version and /metrics stay open. Every error
has the OpenAI shape; after any of them the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import jinja2
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import jaxllm
from jaxllm import reasoning
from jaxllm.engine.async_llm import AsyncLLM, CoreBusy, EngineDeadError
from jaxllm.entrypoints.openai import pooling, responses, serving, tools
from jaxllm.entrypoints.openai.errors import APIError, error_response
from jaxllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsRequest,
)
from jaxllm.entrypoints.scoring import score_pairs
from jaxllm.lora.request import LoRARequest
from jaxllm.messages import check_prompt
from jaxllm.multimodal.image_io import load_image_url
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CORS:
    """Cross-origin requests from browsers (Starlette's CORSMiddleware); no origins: none."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


# the development endpoints (--server-dev-mode, as vLLM's VLLM_SERVER_DEV_MODE): an RL
# trainer's controls of the engine between rollouts
DEV_ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/update_weights", "/pause", "/resume",
              "/is_paused")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | tuple[str, ...] | None = None  # one key, or several (--api-key given more than once)
    max_waiting_requests: int = 256  # beyond max_num_seqs running: more waiting gets 503
    max_num_seqs: int = 64
    max_request_bytes: int = 16 * 2**20
    protected_prefixes: tuple[str, ...] = ("/v1", "/v2", "/pooling", "/score", "/rerank", "/tokenize", "/detokenize",
                                           "/tokenizer_info", *DEV_ROUTES)
    tool_call_parser: str | None = None  # finds tool calls in outputs for tool_choice "auto"
    lora_modules: tuple[LoRARequest, ...] = ()  # adapters loaded at start-up (--lora-modules)
    reasoning_parser: str | None = None  # the engine's: thinking apart from the answer
    default_chat_template_kwargs: dict | None = None  # under each request's chat_template_kwargs
    responses_store_size: int = 1024  # /v1/responses kept for GET and previous_response_id
    runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter served
    lora_allowed_roots: tuple[str, ...] = ()  # where runtime adapters may come from (and the lora_modules' folders)
    cors: CORS = CORS()
    log_requests: bool = False  # each request's prompt and parameters at info level
    max_log_len: int | None = None  # characters (or token ids) of a logged prompt; None: all
    request_id_headers: bool = False  # X-Request-Id on every response
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered
    allowed_local_media_path: str | None = None  # image_url file:// URLs read from under it (none: refused)
    dev_mode: bool = False  # the development endpoints (DEV_ROUTES) served

    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may carry (none: the routes are open; an empty key is none)."""
        keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())
        return tuple(key for key in keys if key)

    def lora_roots(self) -> list[str]:
        """The folders runtime adapters may be loaded from, resolved."""
        return [os.path.realpath(p) for p in (*self.lora_allowed_roots, *(m.lora_path for m in self.lora_modules))]

    def lora_path_allowed(self, path: str) -> bool:
        real = os.path.realpath(path)
        return any(real == root or real.startswith(root + os.sep) for root in self.lora_roots())


class BodySizeLimit:
    """413 for a body over the limit, by Content-Length or by what actually arrives."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise APIError(413, f"request body exceeds {self.limit} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError as e:
            await e.response()(scope, receive, send)

    async def _reject(self, scope, receive, send):
        await error_response(413, f"request body exceeds {self.limit} bytes")(scope, receive, send)


class RequestIdHeader:
    """--enable-request-id-headers: every response carries X-Request-Id, the client's
    own where it sent one, else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        value = given or uuid.uuid4().hex.encode()

        async def with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, with_id)


class APIKeyAuth:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.settings.api_keys()
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # behind --root-path the path carries the prefix (ASGI)
            path = path[len(root):]
        if scope["type"] == "http" and keys and path.startswith(self.settings.protected_prefixes):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            # every key compared (constant time each), so the answer's time says nothing of which
            matches = [hmac.compare_digest(given.encode(), f"Bearer {key}".encode()) for key in keys]
            if not any(matches):
                message = "missing API key" if not given else "incorrect API key"
                return await error_response(401, message, code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the request body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(result: dict | AsyncIterator[str]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


async def until_disconnect(request: Request, make: Callable) -> dict | AsyncIterator[str]:
    """Run a non-streaming request; a client that leaves aborts it at once (the ASGI
    channel says http.disconnect), so its slots and steps are freed."""
    task = asyncio.ensure_future(make())
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return {}
    return task.result()


def guarded(handler: Callable) -> Callable:
    """The endpoint of a handler: every error leaves as an OpenAI error body."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except ValueError as e:
            return APIError.from_value_error(e).response()
        except EngineDeadError as e:
            return error_response(503, str(e))
        except jinja2.TemplateError as e:  # the chat template refused the messages
            return error_response(400, f"messages: the chat template failed: {e}", param="messages")
        except Exception as e:
            logger.exception("error handling %s %s", request.method, request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}")
    return endpoint


class Handlers:
    """The server's endpoints over one engine: each a method taking the request (so
    each can be called in a test without a server), plus the checks they share."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.started = int(time.time())
        self.loras: dict[str, LoRARequest] = {lora.lora_name: lora for lora in settings.lora_modules}
        self._next_lora_id = max((lora.lora_int_id for lora in settings.lora_modules), default=0) + 1
        self._lora_lock = asyncio.Lock()  # one load or unload at a time
        self.responses = responses.ResponseStore(settings.responses_store_size,
                                                 lambda: self.engine.metrics.responses_evicted(0).inc())

    # ------------------------------------------------------------ checks

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        """The body as `model`, or a 400 (bad JSON, bad fields) / 404 (another model)."""
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"invalid JSON body: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise APIError.from_validation_error(e) from None
        if getattr(body, "model", None) not in (None, self.settings.model_name, *self.loras):
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
        return body

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.get(model) if model not in (None, self.settings.model_name) else None

    def model_name(self, model: str | None) -> str:
        """The `model` of a response: the adapter's name, or the base model's."""
        return model if self.lora_for(model) is not None else self.settings.model_name

    def admit(self, num_sequences: int) -> None:
        """Room for a request's sequences (prompts x n: what the engine will hold)."""
        engine = self.engine
        if not engine.is_healthy():
            raise APIError(503, engine.dead_reason or "engine is not healthy", headers={"Retry-After": "5"})
        capacity = self.settings.max_num_seqs + self.settings.max_waiting_requests
        if num_sequences > capacity:
            raise APIError(400, f"n: this request needs {num_sequences} sequences (prompts x n), more than the "
                                f"server holds at once ({capacity})", param="n")
        if engine.num_unfinished_sequences + num_sequences > capacity:
            raise APIError(503, f"too many requests waiting (capacity {capacity} sequences); retry later",
                           headers={"Retry-After": "1"})

    def log_request(self, request_id: str, prompt, params) -> None:
        """With --enable-log-requests: the request's prompt (cut to --max-log-len) and
        its parameters, as vLLM logs them."""
        if not self.settings.log_requests:
            return
        limit = self.settings.max_log_len
        shown = prompt if limit is None else prompt[:limit]
        logger.info("Received request %s: prompt: %r, params: %s", request_id, shown, params)

    def check_priority(self, priority: int) -> None:
        """A ranked request only under the priority policy (vLLM's 400 under fcfs)."""
        if priority and self.engine.config.scheduling_policy != "priority":
            raise APIError(400, "priority: the server schedules first come, first served; start it with "
                                "--scheduling-policy priority to rank requests", param="priority")

    def checked(self, params: SamplingParams) -> SamplingParams:
        """`params` after the checks that need the model (token ids in range, a
        structured output's grammar compiled), so a bad one is a 400 before anything runs."""
        params.validate_for_model(self.engine.ready.vocab_size)
        params.check_beam_width(self.settings.max_num_seqs)
        return params

    def prepare(self, prompt, add_special_tokens: bool, params: SamplingParams) -> tuple[list[int], str | None]:
        """Tokenize and check a prompt now, so a bad one is a 400 before anything runs
        (its last truncate_prompt_tokens kept); max_tokens (None: up to the context)
        must fit after it, as in vLLM."""
        text, ids = self.engine.input_processor.tokenize(prompt, add_special_tokens)
        text, ids = self.engine.input_processor.keep_last(text, ids, params.truncate_prompt_tokens)
        self.check_length(ids, params)
        return ids, text

    def prepare_chat(self, prompt: str | dict, params: SamplingParams) -> tuple[list[int], str, tuple]:
        """`prepare` for a rendered conversation (InputProcessor.chat_prompt): with its
        images (their placeholders expanded, each preprocessed) where it has some."""
        if isinstance(prompt, str):
            return *self.prepare(prompt, False, params), ()
        text, ids, images = self.engine.input_processor.with_images(prompt, params, False)
        self.check_length(ids, params)
        return ids, text, images

    def load_image(self, url: str):
        """An image_url part's image (jaxllm.multimodal.image_io): a data URL, or a file
        URL under --allowed-local-media-path."""
        return load_image_url(url, self.settings.allowed_local_media_path)

    def check_length(self, ids: list[int], params: SamplingParams) -> None:
        engine, max_tokens = self.engine, params.max_tokens
        n, limit = len(ids), engine.ready.max_model_len
        check_prompt(ids, vocab_size=engine.ready.vocab_size, max_model_len=limit)
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                                "Please reduce the length of the messages or completion.", param="max_tokens")

    # --------------------------------------------------------- endpoints

    def require_runner(self, runner: str, endpoint: str) -> None:
        """A 400 for an endpoint the server's runner does not serve, saying how to
        start a server that does."""
        served = self.engine.ready.runner
        if served == runner:
            return
        if runner == "pooling":
            raise APIError(400, f"{endpoint}: {self.settings.model_name} is served for generation (--runner "
                                "generate); embeddings, scores and rerank need a server started with --runner pooling "
                                "(an encoder such as all-MiniLM-L6-v2 is pooled by default)", param="model")
        raise APIError(400, f"{endpoint}: {self.settings.model_name} is served for pooling (--runner pooling): it "
                            "answers /v1/embeddings, /pooling, /score and /rerank; start the server with --runner "
                            "generate to generate text", param="model")

    async def completions(self, request: Request) -> Response:
        self.require_runner("generate", "/v1/completions")
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        self.check_priority(body.priority)
        params = self.checked(body.to_sampling_params())
        prompts = body.prompts()
        self.admit(len(prompts) * params.n)
        rid = serving.new_id("cmpl")
        jobs = []
        for i, prompt in enumerate(prompts):
            ids, text = self.prepare(prompt, True, params)
            jobs.append(serving.Job(f"{rid}-{i}", ids, text, i * params.n, self.lora_for(body.model),
                                    body.cache_salt, body.priority))
            self.log_request(jobs[-1].request_id, text if text is not None else ids, params)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def run():
            shape = serving.CompletionShape(self.engine, body.echo, body.logprobs, body.prompt_logprobs,
                                            body.return_tokens_as_token_ids)
            return serving.completions(self.engine, rid, jobs, params, model=self.model_name(body.model), shape=shape,
                                       stream=body.stream, include_usage=include_usage)

        return await respond(await (run() if body.stream else until_disconnect(request, run)))

    async def chat_completions(self, request: Request) -> Response:
        self.require_runner("generate", "/v1/chat/completions")
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        self.check_priority(body.priority)
        params = self.checked(body.to_sampling_params(default_max_tokens=None))
        tool_mode = self.tool_mode(body)
        self.admit(params.n)
        if body.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(400, "chat_template: a request's own template is rendered only by a server started with "
                                "--trust-request-chat-template (as vLLM's)", param="chat_template")
        prompt = self.engine.input_processor.chat_prompt(
            body.message_dicts(), self.load_image, tools=body.tool_dicts(), chat_template_kwargs=self.template_kwargs(
                body.chat_template_kwargs), **body.render_options())
        ids, prompt, images = self.prepare_chat(prompt, params)
        job = serving.Job(serving.new_id("chatcmpl"), ids, prompt, 0, self.lora_for(body.model), body.cache_salt,
                          body.priority, images)
        self.log_request(job.request_id, prompt, params)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = serving.ChatShape(body.top_logprobs or 0, body.prompt_logprobs, tool_mode,
                                  self.thinking(prompt, body.include_reasoning), body.echoed(),
                                  body.return_tokens_as_token_ids)

        def run():
            return serving.chat(self.engine, job, params, model=self.model_name(body.model), stream=body.stream,
                                include_usage=include_usage, shape=shape)

        return await respond(await (run() if body.stream else until_disconnect(request, run)))

    async def embeddings(self, request: Request) -> Response:
        self.require_runner("pooling", "/v1/embeddings")
        return await self._pooled(request, EmbeddingRequest, "embd", "embedding")

    async def pooling(self, request: Request) -> Response:
        self.require_runner("pooling", "/pooling")
        return await self._pooled(request, PoolingRequest, "pool", "pooling")

    async def _pooled(self, request: Request, kind: type[EmbeddingRequest], prefix: str, item: str) -> Response:
        body: EmbeddingRequest = await self.parse(request, kind)
        pooling.check_encoding_format(body.encoding_format)
        params = body.pooling_params(body.task) if isinstance(body, PoolingRequest) else body.pooling_params()
        inputs = body.inputs()
        self.admit(len(inputs))
        token_ids = pooling.prepare(self.engine, inputs, params, body.add_special_tokens)
        rid = serving.new_id(prefix)

        async def run():
            outputs = await pooling.pool(self.engine, rid, token_ids, params)
            return pooling.embeddings_body(rid, self.model_name(body.model), outputs, body.encoding_format, item)

        return await respond(await until_disconnect(request, run))

    async def score(self, request: Request) -> Response:
        self.require_runner("pooling", "/score")
        body: ScoreRequest = await self.parse(request, ScoreRequest)
        first, second = score_pairs(body.text_1, body.text_2)
        self.admit(len(set(first) | set(second)))
        rid = serving.new_id("score")
        params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens)

        async def run():
            scores, outputs = await pooling.similarities(self.engine, rid, first, second, params)
            return {"id": rid, "object": "list", "created": int(time.time()), "model": self.model_name(body.model),
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                    "usage": pooling.usage(outputs)}

        return await respond(await until_disconnect(request, run))

    async def rerank(self, request: Request) -> Response:
        self.require_runner("pooling", "/rerank")
        body: RerankRequest = await self.parse(request, RerankRequest)
        if not body.documents:
            raise APIError(400, "documents: must not be empty", param="documents")
        self.admit(len(set(body.documents)) + 1)
        rid = serving.new_id("rerank")
        params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens)
        doc_params = (params if body.max_tokens_per_doc is None
                      else PoolingParams(truncate_prompt_tokens=body.max_tokens_per_doc))

        async def run():
            scores, outputs = await pooling.similarities(self.engine, rid, [body.query] * len(body.documents),
                                                         body.documents, params, doc_params)
            ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
            results = [{"index": i, "relevance_score": scores[i]}
                       | ({"document": {"text": body.documents[i]}} if body.return_documents else {})
                       for i in ranked]
            return {"id": rid, "model": self.model_name(body.model), "results": results,
                    "usage": {"total_tokens": pooling.usage(outputs)["total_tokens"]}}

        return await respond(await until_disconnect(request, run))

    async def create_response(self, request: Request) -> Response:
        """POST /v1/responses (jaxllm.entrypoints.openai.responses)."""
        self.require_runner("generate", "/v1/responses")
        body: responses.ResponsesRequest = await self.parse(request, responses.ResponsesRequest)
        body.check_unsupported()
        self.check_priority(body.priority)
        previous = []
        if body.previous_response_id is not None:
            stored = self.responses.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            previous = [m for m in stored[1] if m["role"] != "system"]
        messages = responses.conversation(body, previous)
        chat_tools = body.function_tools()
        choice = body.chat_tool_choice(chat_tools)
        tool_mode = self.tool_mode_for(choice)
        constraint = tools.constraint(chat_tools, choice, body.parallel_tool_calls)
        params = self.checked(body.sampling_params(constraint))
        self.admit(1)
        prompt = self.engine.input_processor.chat_prompt([tools.history_message(m) for m in messages],
                                                         self.load_image, tools=chat_tools or None,
                                                         chat_template_kwargs=self.template_kwargs(None))
        ids, prompt, images = self.prepare_chat(prompt, params)
        reply = responses.Reply(body, messages, self.model_name(body.model), tool_mode,
                                self.thinking(prompt, True), self.reasoning_end_id, self.responses, body.tools or [])
        job = serving.Job(reply.response_id, ids, prompt, 0, self.lora_for(body.model), body.cache_salt,
                          body.priority, images)
        self.log_request(job.request_id, prompt, params)

        def run():
            return responses.respond(self.engine, job, params, reply)

        return await respond(await (run() if body.stream else until_disconnect(request, run)))

    async def get_response(self, request: Request) -> Response:
        stored = self.responses.get(request.path_params["response_id"])
        if stored is None:
            raise APIError(404, f"Response with id '{request.path_params['response_id']}' not found.",
                           param="response_id", code="response_not_found")
        return JSONResponse(stored[0])

    async def delete_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.responses.delete(response_id):
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @functools.cached_property
    def reasoning_end_id(self) -> int | None:
        """The reasoning parser's end marker token (read from the tokenizer once)."""
        name = self.settings.reasoning_parser
        return None if name is None else reasoning.PARSERS[name].token_ids(self.engine.tokenizer)[1]

    def template_kwargs(self, given: dict | None) -> dict:
        """A request's chat template variables over the server's defaults."""
        return (self.settings.default_chat_template_kwargs or {}) | (given or {})

    def thinking(self, prompt: str, include: bool) -> serving.Thinking | None:
        """How the answer's thinking is told apart (None: the server has no reasoning parser)."""
        name = self.settings.reasoning_parser
        if name is None:
            return None
        parser = reasoning.PARSERS[name]
        return serving.Thinking(parser, parser.prompt_state(prompt), include)

    def tool_mode(self, body: ChatCompletionRequest) -> tools.ToolMode | None:
        """How the answer's tool calls are found (None: no tools in play)."""
        return self.tool_mode_for(body.resolved_tool_choice())

    def tool_mode_for(self, choice: str | dict) -> tools.ToolMode | None:
        if choice == "none":
            return None
        parser = self.settings.tool_call_parser
        if choice == "auto" and parser is None:
            raise APIError(400, '"auto" tool choice requires the server to be started with --tool-call-parser '
                                f"({' or '.join(tools.PARSERS)}); or ask for tool_choice \"required\" or a named "
                                "function, which need no parser", param="tool_choice")
        return tools.ToolMode(choice, tools.PARSERS[parser]() if choice == "auto" else None)

    async def models(self, request: Request) -> Response:
        """The base model, then each adapter (vLLM's form: `root` its path, `parent` the base)."""
        base = self.settings.model_name
        card = {"object": "model", "created": self.started, "owned_by": "jaxllm",
                "max_model_len": self.engine.ready.max_model_len}
        adapters = [card | {"id": lora.lora_name, "root": lora.lora_path, "parent": base}
                    for lora in self.loras.values()]
        return JSONResponse({"object": "list", "data": [card | {"id": base, "root": base, "parent": None}, *adapters]})

    async def load_lora_adapter(self, request: Request) -> Response:
        """Read an adapter into the engine (every replica) under a new name; 400 with
        the reason if it cannot be served."""
        self.require_runtime_lora()
        body: LoadLoRAAdapterRequest = await self.parse(request, LoadLoRAAdapterRequest)
        if not self.settings.lora_path_allowed(body.lora_path):  # one answer, whether the path exists or not
            raise APIError(400, "lora_path: not under a folder adapters may be loaded from (--lora-allowed-roots)",
                           param="lora_path")
        if not self.engine.config.enable_lora:
            raise APIError(400, "LoRA is not enabled: start the server with --enable-lora", param="lora_name")
        async with self._lora_lock:
            old = self.loras.get(body.lora_name)
            if body.lora_name == self.settings.model_name:
                raise APIError(400, f"'{body.lora_name}' is the base model's name", param="lora_name")
            if old is not None and not body.load_inplace:
                raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.",
                               param="lora_name")
            lora = LoRARequest(body.lora_name, self._next_lora_id, body.lora_path)
            try:
                await self.engine.add_lora(lora)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path") from None
            self._next_lora_id += 1
            self.loras[body.lora_name] = lora
            if old is not None:  # reloaded in place: the old id's requests finish under it
                await self.engine.remove_lora(old.lora_int_id)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Forget an adapter; requests running under it finish under it. 404 if unknown."""
        self.require_runtime_lora()
        body: UnloadLoRAAdapterRequest = await self.parse(request, UnloadLoRAAdapterRequest)
        async with self._lora_lock:
            lora = self.loras.get(body.lora_name)
            if lora is None:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                               code="model_not_found")
            del self.loras[body.lora_name]
            await self.engine.remove_lora(lora.lora_int_id)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    # ----------------------------------------------- development endpoints

    async def dev_call(self, method: str, *args):
        """An engine core utility for a development endpoint (dev_run's answers)."""
        return await self.dev_run(lambda: self.engine.call_core(method, *args))

    async def dev_run(self, call):
        """Await `call()` for a development endpoint: 404 unless the server is in
        development mode, 409 while requests are in flight, 400 with the reason."""
        if not self.settings.dev_mode:
            raise APIError(404, "development endpoints are off: start the server with --server-dev-mode "
                                "(or VLLM_SERVER_DEV_MODE=1)", code="not_found")
        try:
            return await call()
        except CoreBusy as e:
            raise APIError(409, f"{e} (the requests running must finish first)") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def sleep(self, request: Request) -> Response:
        """POST /sleep?level=1|2: the KV cache and the weights' device memory given back."""
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level: 1 or 2, got {level!r}", param="level")
        await self.dev_call("sleep", int(level))
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        """POST /wake_up[?tags=weights&tags=kv_cache]."""
        await self.dev_call("wake_up", request.query_params.getlist("tags") or None)
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": await self.dev_call("is_sleeping")})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """POST /reset_prefix_cache: 200 once forgotten, 409 while requests hold blocks."""
        if not await self.dev_call("reset_prefix_cache"):
            raise APIError(409, "the prefix cache cannot be reset while requests hold KV blocks")
        return Response(status_code=200)

    async def update_weights(self, request: Request) -> Response:
        """POST /update_weights {"path": ...}: the weights of an HF folder (or GGUF) of
        this model; 400 naming the first parameter that does not fit."""
        body = await self.parse(request, UpdateWeightsRequest)
        await self.dev_call("update_weights_from_path", body.path)
        return Response(status_code=200)

    async def pause(self, request: Request) -> Response:
        """POST /pause?mode=abort|wait|keep&clear_cache=true (vLLM's; its older
        wait_for_inflight_requests=true is mode wait): generation held until /resume;
        answers once the requests in flight are aborted, finished or kept."""
        wait = query_flag(request, "wait_for_inflight_requests", False)
        mode = request.query_params.get("mode", "wait" if wait else "abort")
        clear_cache = query_flag(request, "clear_cache", True)
        await self.dev_run(lambda: self.engine.pause_generation(mode, clear_cache))
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        await self.dev_call("resume")
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": await self.dev_call("is_paused")})

    def require_runtime_lora(self) -> None:
        if not self.settings.runtime_lora_updating:
            raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating "
                                "and --lora-allowed-roots", code="not_found")

    async def health(self, request: Request) -> Response:
        if self.engine.is_healthy():
            return Response(status_code=200)
        return error_response(503, self.engine.dead_reason or "engine core is not making progress")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": jaxllm.__version__})

    async def tokenize(self, request: Request) -> Response:
        body: TokenizeRequest = await self.parse(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        processor = self.engine.input_processor
        if body.messages is not None:
            text = processor.render_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                         add_generation_prompt=body.add_generation_prompt,
                                         chat_template_kwargs=self.template_kwargs(body.chat_template_kwargs))
            _, ids = processor.tokenize(text, add_special_tokens=False)
        else:
            _, ids = processor.tokenize(body.prompt, body.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.ready.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body: DetokenizeRequest = await self.parse(request, DetokenizeRequest)
        vocab = self.engine.ready.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of range [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(body.tokens)})

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(serving.tokenizer_info(self.engine.tokenizer))

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def routes(self) -> list[Route]:
        h = self
        return [
            Route("/v1/completions", guarded(h.completions), methods=["POST"]),
            Route("/v1/chat/completions", guarded(h.chat_completions), methods=["POST"]),
            Route("/v1/responses", guarded(h.create_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", guarded(h.get_response), methods=["GET"]),
            Route("/v1/responses/{response_id}", guarded(h.delete_response), methods=["DELETE"]),
            Route("/v1/models", guarded(h.models), methods=["GET"]),
            Route("/v1/embeddings", guarded(h.embeddings), methods=["POST"]),
            Route("/pooling", guarded(h.pooling), methods=["POST"]),
            *(Route(path, guarded(h.score), methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, guarded(h.rerank), methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
            Route("/v1/load_lora_adapter", guarded(h.load_lora_adapter), methods=["POST"]),
            Route("/v1/unload_lora_adapter", guarded(h.unload_lora_adapter), methods=["POST"]),
            Route("/tokenize", guarded(h.tokenize), methods=["POST"]),
            Route("/detokenize", guarded(h.detokenize), methods=["POST"]),
            Route("/tokenizer_info", guarded(h.tokenizer_info), methods=["GET"]),
            Route("/health", h.health, methods=["GET"]),
            Route("/version", h.version, methods=["GET"]),
            Route("/metrics", h.metrics, methods=["GET"]),
            Route("/sleep", guarded(h.sleep), methods=["POST"]),
            Route("/wake_up", guarded(h.wake_up), methods=["POST"]),
            Route("/is_sleeping", guarded(h.is_sleeping), methods=["GET"]),
            Route("/reset_prefix_cache", guarded(h.reset_prefix_cache), methods=["POST"]),
            Route("/update_weights", guarded(h.update_weights), methods=["POST"]),
            Route("/pause", guarded(h.pause), methods=["POST"]),
            Route("/resume", guarded(h.resume), methods=["POST"]),
            Route("/is_paused", guarded(h.is_paused), methods=["GET"]),
        ]


def query_flag(request: Request, name: str, default: bool) -> bool:
    """A true/false query parameter (400 naming it otherwise)."""
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name}: true or false, got {value!r}", param=name)
    return value.lower() in ("true", "1")


async def _not_found(request: Request, exc) -> Response:
    return error_response(404, f"no route {request.method} {request.url.path}")


async def _method_not_allowed(request: Request, exc) -> Response:
    return error_response(405, f"method {request.method} not allowed on {request.url.path}")


def build_app(engine: AsyncLLM, settings: ServerSettings) -> Starlette:
    """The Starlette app: the handlers' routes, OpenAI error bodies for unknown routes
    and methods, API-key auth and the body size limit; shutting down stops the engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        # uvicorn re-raises SIGINT/SIGTERM once serve() returns, so the engine core must
        # be stopped here, inside the server's own shutdown.
        if engine is not None:  # (an app over no engine: the tests of its middleware)
            await engine.shutdown()

    app = Starlette(routes=Handlers(engine, settings).routes(), lifespan=lifespan)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _method_not_allowed)
    app.add_middleware(APIKeyAuth, settings=settings)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    if settings.request_id_headers:
        app.add_middleware(RequestIdHeader)
    cors = settings.cors
    if cors.allowed_origins:  # outermost: a preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    return app
