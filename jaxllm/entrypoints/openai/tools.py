"""Tool calling for /v1/chat/completions, as vLLM does it.

- `tool_choice` "required" or a named function: the output is constrained (a structured
  output) to what the tools' JSON schemas allow: for a named function its arguments
  object, for "required" a JSON array of `{"name", "parameters"}` (vLLM's form).
- "auto": the model writes calls in its own format and a parser per family finds them
  (`--tool-call-parser`): `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`,
  Qwen2.5/3, Hermes and others) or `llama3_json` (`{"name", "parameters"}` objects,
  optionally after `<|python_tag|>`, separated by `;`).
- "none": tools go to the chat template, nothing is parsed.

Responses carry `message.tool_calls` (ids, names, JSON arguments) and
`finish_reason: "tool_calls"` (not for a named function: "stop", as vLLM answers).
Streamed, every call goes out as it is generated, whatever the choice: its id and name
first, then its arguments' text in pieces, parallel calls each with its `index`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.stop_strings import partial_stop_len

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_json(self, index: int | None = None) -> dict:
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def constraint(tools: list[dict], tool_choice: Any, parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The output constraint a tool_choice implies (None for "auto" and "none")."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=function.get("parameters") or EMPTY_PARAMETERS)
    if tool_choice != "required":
        return None
    choices = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                 "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS},
                "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def forced_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls of an output constrained by `constraint` (required or named)."""
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], text)]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]


# ------------------------------------------------------------------- parsers

class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text
    before the first one is the content."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[at:]):
            try:
                call = json.loads(body)
                calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                return text, []  # not a well-formed call: the text is the answer
        return (text[:at].strip() or None), calls

    def call_start(self, text: str) -> int | None:
        """Where tool calls begin in `text`, if they do (streaming holds text from there)."""
        at = text.find(self.start)
        return None if at < 0 else at

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of `text` from its first block on, the last as far as it has come."""
        return [PartialCall.of(objects(body)[0]) for body in self._block.findall(text) if objects(body)]


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the whole output is `{"name": ..., "parameters": ...}`
    objects separated by `;` (optionally after `<|python_tag|>`)."""

    start = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.start).strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, i = [], json.JSONDecoder(), 0
        try:
            while i < len(body):
                call, i = decoder.raw_decode(body, i)
                calls.append(ToolCall(call["name"], json.dumps(call.get("parameters", call.get("arguments", {})),
                                                               ensure_ascii=False)))
                i = len(body) - len(body[i:].lstrip().removeprefix(";").lstrip())
        except (ValueError, KeyError, TypeError):
            return text, []
        return None, calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("{", self.start)) else None

    def partial_calls(self, text: str) -> list[PartialCall]:
        return [PartialCall.of(o) for o in objects(text.strip().removeprefix(self.start), ";")]


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclasses.dataclass(frozen=True)
class PartialCall:
    """A tool call as far as it has been generated: its name once the name's string is
    closed, its arguments' JSON text so far (`done`: the whole object)."""

    name: str | None
    arguments: str
    done: bool

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(\s*,\s*"(?:arguments|parameters)"\s*:\s*)?')

    @classmethod
    def of(cls, text: str) -> PartialCall:
        """`{"name": ..., "arguments" (or "parameters"): {...}}` as far as `text` goes
        (the name first, as the formats and the required-call schema write it)."""
        head = cls._HEAD.match(text)
        if head is None:
            return cls(None, "", False)
        name = json.loads(f'"{head.group(1)}"')
        if head.group(2) is None:
            return cls(name, "", False)
        try:
            _, end = json.JSONDecoder().raw_decode(text, head.end())
            return cls(name, text[head.end():end], True)
        except ValueError:
            return cls(name, text[head.end():], False)


def objects(text: str, separators: str = "") -> list[str]:
    """The JSON objects of `text` one after another (whitespace and `separators` between
    them skipped): the complete ones whole, then the last as far as it goes; stops at
    anything else."""
    found, i, decoder = [], 0, json.JSONDecoder()
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i >= len(text) or text[i] != "{":
            return found
        try:
            _, end = decoder.raw_decode(text, i)
        except ValueError:
            return found + [text[i:]]
        found.append(text[i:end])
        i = end


def history_message(message: dict) -> dict:
    """An assistant message's tool_calls as chat templates expect them (arguments as a
    dict, as transformers' templates read them; vLLM does the same)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except ValueError:
            raise ValueError("messages: a tool call's arguments must be a JSON object string") from None
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}


# ------------------------------------------------------------------ answers

@dataclasses.dataclass(frozen=True)
class ToolMode:
    """How a chat answer's tool calls are found: forced (`choice` "required" or a named
    function, the output is their JSON) or parsed (`choice` "auto" and a parser)."""

    choice: str | dict
    parser: HermesParser | Llama3JsonParser | None = None

    @property
    def forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, dict)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and its finish reason."""
        if self.forced:
            if finish_reason != "stop":  # cut short (length, abort): no whole call to report
                return {"role": "assistant", "content": text}, finish_reason
            calls = forced_calls(text, self.choice)
            return ({"role": "assistant", "content": None, "tool_calls": [c.as_json() for c in calls]},
                    "tool_calls" if self.choice == "required" else finish_reason)
        content, calls = self.parser.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [c.as_json() for c in calls]}, "tool_calls"


class ToolStream:
    """One streamed choice's deltas under a ToolMode, each call as it is generated: its
    id and name once the name is written, then its arguments' text piece by piece (a
    named function's from the first token). "auto" streams content until a call starts,
    holding back what could begin its marker; text the end shows to be no call after all
    goes out as content then. A call cut short (max_tokens) stays as far as it was
    streamed, with that finish reason."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode, self.text, self.sent = mode, "", 0
        self.calls: list[tuple[str, int]] = []  # per call started: its id, the arguments' characters sent

    def feed(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta to send for this piece of output, and the finish reason to report."""
        self.text += text
        if isinstance(self.mode.choice, dict):
            return self._calls([PartialCall(self.mode.choice["function"]["name"], self.text, False)]), finish_reason
        if finish_reason is not None:
            return self._finish(finish_reason)
        if self.mode.forced:
            return self._calls(self._forced_calls()), None
        start = self.mode.parser.call_start(self.text)
        if start is None:
            held = partial_stop_len(self.text, [self.mode.parser.start])  # could begin a call's marker
            return self._content_until(len(self.text) - held), None
        return self._content_until(start) | self._calls(self.mode.parser.partial_calls(self.text[start:])), None

    def _forced_calls(self) -> list[PartialCall]:
        body = self.text.lstrip()
        return [PartialCall.of(o) for o in objects(body[1:], ",")] if body.startswith("[") else []

    def _calls(self, calls: list[PartialCall]) -> dict:
        """The tool-call deltas of what `calls` add to what was sent: one entry per call
        (a new call's with its id, type and name)."""
        entries = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            entry: dict = {"index": index}
            if index == len(self.calls):
                self.calls.append((ToolCall(call.name, "").as_json()["id"], 0))
                entry |= {"id": self.calls[index][0], "type": "function", "function": {"name": call.name}}
            call_id, sent = self.calls[index]
            function = entry.setdefault("function", {})
            function["arguments"] = call.arguments[sent:]
            self.calls[index] = (call_id, max(sent, len(call.arguments)))
            if "id" in entry or function["arguments"]:
                entries.append(entry)
        return {"tool_calls": entries} if entries else {}

    def _content_until(self, end: int) -> dict:
        if end <= self.sent:
            return {}
        delta = {"content": self.text[self.sent:end]}
        self.sent = end
        return delta

    def _finish(self, finish_reason: str) -> tuple[dict, str | None]:
        """The end: the rest of each call (its arguments as the whole output parses), or,
        where the output holds no well-formed call, the held-back text as content."""
        message, reason = self.mode.message(self.text, finish_reason)
        if "tool_calls" not in message:
            if self.calls:  # calls cut short (max_tokens): they stay as streamed
                return {}, reason
            return self._content_until(len(self.text)), reason  # no calls: the rest of the text is content
        delta = {} if self.mode.forced else self._content_until(self.mode.parser.call_start(self.text))
        final = [PartialCall(c["function"]["name"], self._arguments_text(i, c), True)
                 for i, c in enumerate(message["tool_calls"])]
        return delta | self._calls(final), reason

    def _arguments_text(self, index: int, call: dict) -> str:
        """A finished call's arguments as streamed so far plus the rest of its raw text
        (streamed text is the model's own, not re-serialized): the parsed form where the
        raw one is not known."""
        partial = (self._forced_calls() if self.mode.forced
                   else self.mode.parser.partial_calls(self.text[self.mode.parser.call_start(self.text):]))
        if index < len(partial) and partial[index].done:
            return partial[index].arguments
        return call["function"]["arguments"]
