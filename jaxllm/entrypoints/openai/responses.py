"""/v1/responses: OpenAI's Responses API, vLLM's subset of it, over the chat machinery.

A request's `input` (a string, or items: messages, `function_call`, `function_call_output`
and `reasoning` items) and `instructions` become a chat conversation the model's template
renders, after the stored conversation `previous_response_id` names. The answer comes
back as output items: a `reasoning` item (with `--reasoning-parser`), a `message` with
its `output_text`, and one `function_call` item per tool call; streamed, as the event
sequence the openai client's `responses.stream` reads, each event numbered.

What is refused, with a 400 naming the field: built-in tools (web search, file search,
MCP, ...), `background`, `include` entries, `reasoning.effort` and the other fields
jaxllm does not implement; unknown item types; a `function_call_output` whose `call_id`
matches no call; `previous_response_id` naming a response not stored (404).
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxllm.engine.output_processor import RequestOutputKind
from jaxllm.entrypoints.openai import serving
from jaxllm.entrypoints.openai.protocol import JsonSchemaFormat
from jaxllm.entrypoints.openai.tools import ToolMode, ToolStream
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.reasoning import split as split_reasoning
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

# ------------------------------------------------------------------ request


class TextFormat(JsonSchemaFormat):
    """text.format: chat's json_schema fields (name, description, schema, strict) flat
    beside the type, as the Responses API puts them."""

    type: Literal["text", "json_schema", "json_object"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool = False
    truncation: Literal["disabled"] | None = None
    # vLLM's extras
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache blocks shared only within one salt
    priority: int = 0  # lower first under --scheduling-policy priority
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

    def check_unsupported(self) -> None:
        """ValueError naming a field asked for what jaxllm does not do."""
        if self.background:
            raise ValueError("background: background responses are not supported; leave it false")
        if self.include:
            raise ValueError(f"include: {', '.join(self.include)} cannot be included (nothing extra is returned)")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise ValueError("reasoning: effort and summary are not supported (the model thinks as its template "
                             "says; chat_template_kwargs are on /v1/chat/completions)")

    def function_tools(self) -> list[dict]:
        """The tools in chat's shape ({"type": "function", "function": {...}});
        ValueError for a built-in tool."""
        out = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tools.{i}.type: {kind!r} is a built-in tool jaxllm does not run; only function "
                                 "tools are supported")
            unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
            if unknown or not isinstance(tool.get("name"), str):
                raise ValueError(f"tools.{i}: a function tool has type, name, description, parameters and strict"
                                 + (f" (not {', '.join(sorted(unknown))})" if unknown else " (name is missing)"))
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def chat_tool_choice(self, tools: list[dict]) -> str | dict:
        """tool_choice as chat takes it (default: auto with tools, none without)."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if tools else "none"
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError("tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}")
            if choice["name"] not in {t["function"]["name"] for t in tools}:
                raise ValueError(f"tool_choice: no tool is named {choice['name']!r}")
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice: {choice} needs tools")
        return choice

    def text_constraint(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise ValueError("text.format.schema: a json_schema format needs its schema")
        return StructuredOutputsParams(json=fmt.json_schema)

    def sampling_params(self, tool_constraint: StructuredOutputsParams | None) -> SamplingParams:
        """A required or named tool call's constraint in place of text.format's (that
        turn's output is calls, no text to format: agent frameworks send both)."""
        constraint = tool_constraint or self.text_constraint()
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()} or None
        except ValueError:
            raise ValueError("logit_bias: keys must be token ids") from None
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                              max_tokens=self.max_output_tokens, logit_bias=bias, ignore_eos=self.ignore_eos,
                              structured_outputs=constraint)


# ------------------------------------------------------------ conversation

def conversation(request: ResponsesRequest, previous: list[dict]) -> list[dict]:
    """The chat messages of `request` after `previous` (a stored conversation): the
    instructions as the system message (not carried from earlier responses), then the
    input's items; ValueError naming an item that cannot be one."""
    messages = [dict(m) for m in previous]
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    pending_reasoning = None
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input.{i}"
        if kind == "message":
            message = {"role": _role(item, where), "content": _content(item.get("content"), where)}
            if message["role"] == "assistant" and pending_reasoning is not None:
                message["reasoning_content"], pending_reasoning = pending_reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and pending_reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]}
                                | ({"reasoning_content": pending_reasoning} if pending_reasoning else {}))
                pending_reasoning = None
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            known = {c["id"] for m in messages for c in m.get("tool_calls") or []}
            if call_id not in known:
                raise ValueError(f"{where}.call_id: no function_call before it has call_id {call_id!r}")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            pending_reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ValueError(f"{where}.type: {kind!r} is not an input item jaxllm takes (message, function_call, "
                             "function_call_output, reasoning)")
    if request.instructions:
        messages = [{"role": "system", "content": request.instructions}] + [
            m for m in messages if m["role"] != "system"]
    return messages


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ValueError(f"{where}.role: {role!r} is not user, system, developer or assistant")
    return "system" if role == "developer" else role


def _content(content, where: str) -> str | list[dict]:
    """A message's content for the chat template: a string, its text parts joined, or
    with `input_image` parts (image_url: a data URL) the chat API's text and image_url
    parts (read by a vision-language model, refused by a text-only one)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise ValueError(f"{where}.content.{j}.image_url: an input_image needs its image_url (a data URL); "
                                 "file_id is not supported")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            raise ValueError(f"{where}.content.{j}.type: {kind!r} parts are not supported (input_text, "
                             "output_text, input_image)")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{name}: a string is required")
    return value


# ----------------------------------------------------------------- answers

@dataclass
class Answer:
    """The output items of one finished generation, as the response lists them."""

    reasoning: str | None
    content: str | None
    calls: list[dict]  # chat's tool-call dicts (id, function name and arguments)
    finish_reason: str | None

    @classmethod
    def of(cls, c: CompletionOutput, tool_mode: ToolMode | None, thinking: serving.Thinking | None) -> Answer:
        reasoning, content = (None, c.text) if thinking is None else split_reasoning(
            thinking.parser, c.text, thinking.prompt_state)
        calls = []
        if tool_mode is not None:
            message, _ = tool_mode.message(content or "", c.finish_reason)
            content, calls = message.get("content"), message.get("tool_calls") or []
        return cls(reasoning if thinking is None or thinking.include else None, content or None, calls,
                   c.finish_reason)

    def items(self, ids: ItemIds) -> list[dict]:
        out = []
        if self.reasoning:
            out.append(reasoning_item(ids.reasoning, self.reasoning, "completed"))
        if self.content is not None:
            out.append(message_item(ids.message, self.content, "completed"))
        out += [call_item(ids.call(i), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
                for i, c in enumerate(self.calls)]
        return out

    def message(self) -> dict:
        """The assistant's turn as a chat message (what a later response continues)."""
        return ({"role": "assistant", "content": self.content}
                | ({"tool_calls": self.calls} if self.calls else {})
                | ({"reasoning_content": self.reasoning} if self.reasoning else {}))


@dataclass
class ItemIds:
    """The output items' ids of one response."""

    reasoning: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    message: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    calls: list[str] = field(default_factory=list)

    def call(self, index: int) -> str:
        while len(self.calls) <= index:
            self.calls.append(f"fc_{uuid.uuid4().hex}")
        return self.calls[index]


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(output: RequestOutput, generated: int, reasoning_tokens: int) -> dict:
    prompt, cached = len(output.prompt_token_ids), output.num_cached_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + generated}


def reasoning_tokens(c: CompletionOutput, answer: Answer, end_id: int | None) -> int:
    """The output tokens that were thinking: up to its end marker (all of them where it
    never ended)."""
    if not answer.reasoning:
        return 0
    return c.token_ids.index(end_id) + 1 if end_id in c.token_ids else len(c.token_ids)


# ---------------------------------------------------------------- the store

class ResponseStore:
    """Responses kept for GET /v1/responses/{id} and previous_response_id: the response
    body and its whole conversation, the least recently stored dropped beyond `size`
    (each drop counted by `on_evict`)."""

    def __init__(self, size: int, on_evict: Callable[[], None] = lambda: None) -> None:
        self.size, self.on_evict = size, on_evict
        self._kept: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, body: dict, messages: list[dict]) -> None:
        if self.size <= 0:
            return
        self._kept[body["id"]] = (body, messages)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
            self.on_evict()

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None


# ------------------------------------------------------------------ running

@dataclass
class Reply:
    """What one response needs besides the engine: its request, the conversation it
    continues, how tool calls and thinking are found, and where it is stored."""

    request: ResponsesRequest
    messages: list[dict]  # the conversation sent (the stored one, then this input)
    model: str
    tool_mode: ToolMode | None
    thinking: serving.Thinking | None
    end_id: int | None  # the reasoning parser's end marker token
    store: ResponseStore
    tools: list[dict]  # as the request gave them
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], use: dict | None, finish_reason: str | None) -> dict:
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "incomplete_details": incomplete, "error": None, "model": self.model, "output": output,
                "instructions": r.instructions, "tools": self.tools,
                "tool_choice": r.tool_choice if r.tool_choice is not None else ("auto" if self.tools else "none"),
                "parallel_tool_calls": r.parallel_tool_calls, "temperature": r.temperature, "top_p": r.top_p,
                "max_output_tokens": r.max_output_tokens, "previous_response_id": r.previous_response_id,
                "metadata": r.metadata or {}, "user": r.user, "store": r.store, "truncation": "disabled",
                "text": {"format": (r.text.format.model_dump(by_alias=True, exclude_none=True)
                                    if r.text and r.text.format else {"type": "text"})},
                "reasoning": {"effort": None, "summary": None}, "usage": use}

    def finish(self, output: RequestOutput, c: CompletionOutput, ids: ItemIds,
               streamed: list[dict] | None = None) -> dict:
        """The finished response (stored where asked) for `c`, the whole generation
        (`output`: its request's last output, for the prompt's counts); `streamed`: the
        items a stream sent, which it keeps (their call ids among them)."""
        answer = Answer.of(c, self.tool_mode, self.thinking)
        if streamed is not None:
            call_ids = [item["call_id"] for item in streamed if item["type"] == "function_call"]
            for call, call_id in zip(answer.calls, call_ids):
                call["id"] = call_id
        items = streamed if streamed is not None else answer.items(ids)
        use = usage(output, len(c.token_ids), reasoning_tokens(c, answer, self.end_id))
        body = self.body("completed", items, use, c.finish_reason)
        if self.request.store:
            self.store.put(body, self.messages + [answer.message()])
        return body


async def respond(engine, job: serving.Job, params: SamplingParams, reply: Reply) -> dict | AsyncIterator[str]:
    """The response to one request: its body, or its events as server-sent events."""
    if not reply.request.stream:
        final = None
        async for _, output in serving.merged(engine, [job], params, RequestOutputKind.FINAL_ONLY):
            final = output
        return reply.finish(final, final.outputs[0], ItemIds())
    return ResponseEvents(reply).events(engine, job, params)


@dataclass
class ResponseEvents:
    """A streamed response: the events of its items as the text comes."""

    reply: Reply
    ids: ItemIds = field(default_factory=ItemIds)
    sequence: int = 0
    output: list[dict] = field(default_factory=list)  # the items added so far (their final form when done)
    open_item: str | None = None  # the item being streamed: "reasoning", "message", "call" or None
    texts: dict[str, str] = field(default_factory=lambda: {"reasoning": "", "message": ""})
    call_items: dict[int, int] = field(default_factory=dict)  # call index -> its output index

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def events(self, engine, job: serving.Job, params: SamplingParams) -> AsyncIterator[str]:
        reply = self.reply
        yield self.event("response.created", response=reply.body("in_progress", [], None, None))
        yield self.event("response.in_progress", response=reply.body("in_progress", [], None, None))
        splitter = reply.thinking.splitter() if reply.thinking is not None else None
        tool_stream = ToolStream(reply.tool_mode) if reply.tool_mode is not None else None
        text, tokens, last = "", [], None
        try:
            async for _, output in serving.merged(engine, [job], params, RequestOutputKind.DELTA):
                last = output
                c = output.outputs[0]
                text, tokens = text + c.text, tokens + c.token_ids
                reasoning, content = (splitter.feed(c.text, final=c.finish_reason is not None)
                                      if splitter is not None else ("", c.text))
                for e in self._reasoning(reasoning):
                    yield e
                delta = tool_stream.feed(content, c.finish_reason)[0] if tool_stream is not None else {
                    "content": content}
                for e in self._content(delta.get("content") or ""):
                    yield e
                for e in self._calls(delta.get("tool_calls") or []):
                    yield e
        except (ValueError, RuntimeError) as e:
            error = serving.stream_error(e)["error"]
            yield self.event("error", message=error["message"], code=error["code"], param=error["param"])
            return
        for e in self._close():
            yield e
        whole = CompletionOutput(0, text, tokens, finish_reason=last.outputs[0].finish_reason)
        body = reply.finish(last, whole, self.ids, self.output)
        yield self.event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                         response=body)

    def _open(self, kind: str, item: dict) -> list[str]:
        events = self._close()
        self.open_item = kind
        self.output.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=output_text("")))
        return events

    def _reasoning(self, text: str) -> list[str]:
        if not text or not (self.reply.thinking and self.reply.thinking.include):
            return []
        events = [] if self.open_item == "reasoning" else self._open(
            "reasoning", reasoning_item(self.ids.reasoning, "", "in_progress"))
        self.texts["reasoning"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=self.ids.reasoning,
                                 output_index=len(self.output) - 1, content_index=0, delta=text))
        return events

    def _content(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open_item == "message" else self._open(
            "message", message_item(self.ids.message, None, "in_progress"))
        self.texts["message"] += text
        events.append(self.event("response.output_text.delta", item_id=self.ids.message,
                                 output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _calls(self, deltas: list[dict]) -> list[str]:
        events = []
        for d in deltas:
            index, function = d["index"], d["function"]
            if "id" in d:  # a new call: its item
                item_id = self.ids.call(index)
                events += self._open("call", call_item(item_id, d["id"], function["name"], "", "in_progress"))
                self.call_items[index] = len(self.output) - 1
            if function.get("arguments"):
                at = self.call_items[index]
                self.output[at]["arguments"] += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.ids.call(index),
                                         output_index=at, delta=function["arguments"]))
        return events

    def _close(self) -> list[str]:
        """The done events of the open item (a call's: of every call started)."""
        kind, self.open_item = self.open_item, None
        if kind is None:
            return []
        at = len(self.output) - 1
        item = self.output[at]
        if kind == "reasoning":
            text = self.texts["reasoning"]
            item.update(reasoning_item(item["id"], text, "completed"))
            return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                               text=text),
                    self.event("response.output_item.done", output_index=at, item=item)]
        if kind == "message":
            text = self.texts["message"]
            item.update(message_item(item["id"], text, "completed"))
            return [self.event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                               text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                               part=output_text(text)),
                    self.event("response.output_item.done", output_index=at, item=item)]
        events = []
        for at in sorted(self.call_items.values()):
            call = self.output[at]
            if call["status"] == "completed":
                continue
            call["status"] = "completed"
            events += [self.event("response.function_call_arguments.done", item_id=call["id"], output_index=at,
                                  name=call["name"], arguments=call["arguments"]),
                       self.event("response.output_item.done", output_index=at, item=call)]
        return events
