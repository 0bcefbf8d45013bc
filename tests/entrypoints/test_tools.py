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


def test_held_back_is_the_longest_marker_prefix_at_the_end():
    assert tools.held_back("hello <tool", "<tool_call>") == 5
    assert tools.held_back("hello <", "<tool_call>") == 1
    assert tools.held_back("hello", "<tool_call>") == 0


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

    auto = tools.ToolStream(tools.ToolMode("auto", tools.HermesParser()))
    out = [auto.feed(p, None) for p in ["Sure. <to", 'ol_call>{"name": "get_time", ', '"arguments": {}}']]
    assert [d for d, _ in out] == [{"content": "Sure. "}, {}, {}]
    delta, reason = auto.feed("</tool_call>", "stop")
    assert reason == "tool_calls" and delta["tool_calls"][0]["function"]["name"] == "get_time"
    plain = tools.ToolStream(tools.ToolMode("auto", tools.HermesParser()))
    assert plain.feed("a <", None) == ({"content": "a "}, None)
    assert plain.feed("b", "stop") == ({"content": "<b"}, "stop")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
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
