"""A reasoning model's thinking through `python -m jaxllm.serve --reasoning-parser`: the
Qwen3-shaped test model (random weights, Qwen3's chat template and <think> tokens),
its outputs driven by logit_bias and structured outputs where a random model would
write nothing of the kind."""

import json

import make_test_model
import pytest
from transformers import AutoTokenizer

from tests.support.server import Server

THINK, END = "<think>", "</think>"
ANSWER_RE = "[a-z]{3,8} is [0-9]{1,3}"
USER = [{"role": "user", "content": "How hot is it?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_test_model.write_reasoning_model(tmp_path_factory.mktemp("reasoning"))


@pytest.fixture(scope="module")
def ids(model):
    tok = AutoTokenizer.from_pretrained(model)
    think, end = (tok.convert_tokens_to_ids(t) for t in (THINK, END))
    return {"think": think, "end": end, "tok": tok}


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("reasoning_server"), "--max-model-len", "1024", "--served-model-name", "q",
               "--reasoning-parser",
               "qwen3", "--tool-call-parser", "hermes")
    yield s
    s.stop()


def chat(server, stream=False, **kw):
    return server.client().chat.completions.create(model="q", messages=USER, temperature=0, stream=stream, **kw)


def streamed(server, **kw) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) joined from a stream's deltas."""
    reasoning, content, finish = "", "", None
    for chunk in chat(server, stream=True, **kw):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return reasoning, content, finish


def test_thinking_then_a_structured_answer(server, ids):
    """The template opens no block, so the first token may open one (the grammar's mask
    lets <think> through: bias +50); inside, nothing is masked (</think> at +100 ends it
    at once); then the grammar shapes the answer, which alone is `content`."""
    kw = dict(max_tokens=40, logit_bias={str(ids["think"]): 50, str(ids["end"]): 100},
              extra_body={"structured_outputs": {"regex": ANSWER_RE}})
    r = chat(server, **kw)
    message = r.choices[0].message
    extra = message.model_extra
    assert extra.get("reasoning") is None and extra.get("reasoning_content") is None  # an empty thinking
    assert message.content is not None and __import__("re").fullmatch(ANSWER_RE, message.content)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 2 + len(ids["tok"].encode(message.content, add_special_tokens=False)) + 1
    reasoning, content, finish = streamed(server, **kw)
    assert (reasoning, content, finish) == ("", message.content, "stop")


def test_thinking_cut_short_is_all_reasoning(server, ids):
    """A thinking that max_tokens cuts (<think> at +100: it opens the block, then is all
    the block holds): every token after the first is reasoning, none is content;
    include_reasoning false drops it; the stream's deltas join to the same."""
    kw = dict(max_tokens=6, logit_bias={str(ids["think"]): 100}, extra_body={"ignore_eos": True})
    r = chat(server, **kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == THINK * 5
    assert message.content is None and r.choices[0].finish_reason == "length"
    assert streamed(server, **kw) == (message.model_extra["reasoning"], "", "length")
    hidden = chat(server, **kw | {"extra_body": {"ignore_eos": True, "include_reasoning": False}}).choices[0].message
    assert "reasoning" not in hidden.model_extra and hidden.content is None


def test_enable_thinking_false_closes_the_block_in_the_prompt(server, ids):
    """chat_template_kwargs reach the template: Qwen3's enable_thinking false closes an
    empty block in the prompt (two more prompt tokens and the block's newlines), so the
    output may not open one (<think> at +100 is masked by the grammar from the first
    token) and is all content."""
    kw = dict(max_tokens=40, logit_bias={str(ids["think"]): 100},
              extra_body={"structured_outputs": {"regex": ANSWER_RE}, "chat_template_kwargs": {"enable_thinking": False}})
    r = chat(server, **kw)
    assert __import__("re").fullmatch(ANSWER_RE, r.choices[0].message.content)
    assert "reasoning" not in r.choices[0].message.model_extra
    thinking_on = chat(server, max_tokens=1)
    assert r.usage.prompt_tokens > thinking_on.usage.prompt_tokens


def test_a_required_call_follows_the_thinking(server, ids):
    """tool_choice required: the grammar of the calls starts after the thinking, and the
    calls are read from the answer alone (streamed: the same call, name first)."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
    kw = dict(max_tokens=60, tools=tools, tool_choice="required",
              logit_bias={str(ids["think"]): 50, str(ids["end"]): 100})
    choice = chat(server, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    deltas = [d for chunk in chat(server, stream=True, **kw) for c in chunk.choices for d in c.delta.tool_calls or []]
    assert deltas[0].function.name == "get_time" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "yes"}, "chat_template_kwargs"),
])
def test_bad_template_arguments_are_400(server, body, param):
    import httpx

    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "q", "messages": USER, **body},
                   headers={"Authorization": "Bearer test-key"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
