"""Tool calling pieces without a server: the tool parsers, the constraint a tool_choice
implies, and the streamed deltas (the server tests drive them end to end)."""

import json

import jsonschema
import pytest

from jaxllm.entrypoints.openai import tools
from jaxllm.entrypoints.openai.api_server import Handlers, ServerSettings
from jaxllm.entrypoints.openai.errors import APIError
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_hermes_parser():
    p = tools.HermesParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert p.call_start("abc<tool_call>") == 3 and p.call_start("abc<tool") is None


def test_llama3_json_parser():
    p = tools.Llama3JsonParser()
    content, calls = p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                             '{"name": "get_time", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert p.parse("Oslo is cold.") == ("Oslo is cold.", [])
    assert p.call_start("  {") == 2 and p.call_start("Hi") is None


def test_required_constraint_accepts_exactly_calls_of_the_tools():
    c = tools.constraint([WEATHER, TIME], "required", parallel_tool_calls=False)
    schema = json.loads(c.json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "get_time", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tools.constraint([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert json.loads(named.json) == WEATHER["function"]["parameters"]


def test_tool_stream_deltas_reassemble():
    named = tools.ToolStream(tools.ToolMode({"type": "function", "function": {"name": "get_weather"}}))
    deltas = [named.feed(piece, None)[0] for piece in ['{"ci', 'ty": "R', 'ome"}']]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Rome"}'
    assert named.feed("", "stop") == ({}, "stop")

    plain = tools.ToolStream(tools.ToolMode("auto", tools.HermesParser()))
    assert plain.feed("a <", None) == ({"content": "a "}, None)
    assert plain.feed("b", "stop") == ({"content": "<b"}, "stop")


def join_calls(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined as a client joins them: by index, the id, type and name
    from the first, the arguments concatenated."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for d in delta.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"name": None, "arguments": "", "id": None})
            call["id"] = call["id"] or d.get("id")
            call["name"] = call["name"] or d["function"].get("name")
            call["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


AUTO_TEXT = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
REQUIRED_TEXT = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
LLAMA3_TEXT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'


@pytest.mark.parametrize("mode, text", [
    (tools.ToolMode("auto", tools.HermesParser()), AUTO_TEXT),
    (tools.ToolMode("required"), REQUIRED_TEXT),
    (tools.ToolMode("auto", tools.Llama3JsonParser()), LLAMA3_TEXT),
])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_calls_stream_as_they_are_generated(mode, text, size):
    """Fed `size` characters at a time: each call's name goes out once written, then its
    arguments in pieces before the output ends; joined, the calls the whole output
    parses to (names, arguments, one id each), and the content before them."""
    stream = tools.ToolStream(mode)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [stream.feed(p, None)[0] for p in pieces[:-1]]
    last, reason = stream.feed(pieces[-1], "stop")
    calls = join_calls(deltas + [last])
    message, want_reason = mode.message(text, "stop")
    assert reason == want_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert all(c["id"] for c in calls) and len({c["id"] for c in calls}) == len(calls)
    early = join_calls(deltas)  # before the end: both names, and the first call's arguments whole
    assert [c["name"] for c in early] == ["get_weather", "get_time"]
    assert json.loads(early[0]["arguments"]) == json.loads(message["tool_calls"][0]["function"]["arguments"])
    content = "".join(d.get("content", "") for d in deltas + [last])
    assert content.strip() == (message["content"] or "")


def test_a_call_cut_short_stays_as_streamed():
    stream = tools.ToolStream(tools.ToolMode("required"))
    first, _ = stream.feed('[{"name": "get_weather", "parameters": {"ci', None)
    assert join_calls([first]) == [{"name": "get_weather", "arguments": '{"ci', "id": first["tool_calls"][0]["id"]}]
    assert stream.feed('ty": "Os', "length") == ({}, "length")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"json_object": True}}, "tool_choice"),
])
def test_bad_tool_requests_name_their_field(body, param):
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(ValueError, match=f"^{param}: "):
        request.to_sampling_params(None)


def test_auto_needs_a_parser():
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [WEATHER]})
    with pytest.raises(APIError) as e:
        Handlers(None, ServerSettings(model_name="m")).tool_mode(request)
    assert e.value.param == "tool_choice" and "--tool-call-parser" in str(e.value)
    mode = Handlers(None, ServerSettings(model_name="m", tool_call_parser="hermes")).tool_mode(request)
    assert isinstance(mode.parser, tools.HermesParser)
