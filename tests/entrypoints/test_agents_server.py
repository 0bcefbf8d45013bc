"""What agents use, through `python -m jaxllm.serve --reasoning-parser qwen3`: a reasoning
model's thinking kept apart, tool calls, and the Responses API (/v1/responses) with the
openai client. The Qwen3-shaped test model (random weights, Qwen3's chat template and
<think> tokens) has its outputs driven by logit_bias and structured outputs where a
random model would write nothing of the kind."""

import json

import make_test_model
import openai
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
    s = Server(model, tmp_path_factory.mktemp("agents_server"), "--max-model-len", "2048", "--served-model-name", "q",
               "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--responses-store-size", "4",
               # named backends: nothing measured at start-up; single decode steps: no decode loops to compile (the
               # parsers and the Responses API are the point)
               "--attention-backend", "cpu", "--linear-backend", "cpu", "--num-scheduler-steps", "1")
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


# ------------------------------------------------------------------ /v1/responses

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "degrees": {"type": "integer"}},
          "required": ["city", "degrees"], "additionalProperties": False}
def quick_thinking(ids) -> dict:
    """The output opens a block and closes it at once (an empty thinking)."""
    return {"logit_bias": {str(ids["think"]): 50, str(ids["end"]): 100}}


def test_a_response_under_a_schema_is_stored_continued_and_deleted(server, ids):
    client = server.client()
    kw = dict(model="q", instructions="Answer in JSON.", temperature=0, max_output_tokens=60,
              text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
              extra_body=quick_thinking(ids))
    r = client.responses.create(input="Weather in Paris?", **kw)
    assert r.status == "completed" and [item.type for item in r.output] == ["message"]
    answer = json.loads(r.output_text)
    assert answer["city"] in ("Paris", "Oslo") and isinstance(answer["degrees"], int)
    assert r.usage.output_tokens > 2 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text
    follow = client.responses.create(input="And in Oslo?", previous_response_id=r.id, **kw)
    # the stored conversation comes first: the question, the answer, then the new question
    alone = client.responses.create(input="And in Oslo?", **kw)
    assert follow.usage.input_tokens > alone.usage.input_tokens + r.usage.output_tokens - 4
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="Previous response with id"):
        client.responses.create(input="Again?", previous_response_id=r.id, **kw)


def test_the_stream_sends_the_events_in_order_and_the_same_text(server, ids):
    client = server.client()
    kw = dict(model="q", input="Weather?", temperature=0, max_output_tokens=60, store=False,
              text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}},
              extra_body=quick_thinking(ids))
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_function_tools_in_a_two_turn_loop(server, ids):
    """tool_choice required: a function_call item; its output goes back as a
    function_call_output item, and the model answers; streamed, the call's arguments
    come as deltas joined to the same call."""
    client = server.client()
    tools = [{"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}]
    first = client.responses.create(model="q", input="Time?", tools=tools, tool_choice="required", temperature=0,
                                    max_output_tokens=200, extra_body=quick_thinking(ids))
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet") and call.call_id
    history = [{"role": "user", "content": "Time?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "12:00 in the zone asked"}]
    second = client.responses.create(model="q", input=history, tools=tools, tool_choice="none", temperature=0,
                                     max_output_tokens=3, extra_body={"ignore_eos": True} | quick_thinking(ids))
    assert second.output[-1].type == "message" and second.usage.output_tokens == 3
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output rendered
    with client.responses.stream(model="q", input="Time?", tools=tools, tool_choice="required", temperature=0,
                                 max_output_tokens=200, extra_body=quick_thinking(ids)) as stream:
        events = list(stream)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(arguments) == json.loads(done[0].arguments) == json.loads(call.arguments)


def test_parse_into_a_pydantic_model(server, ids):
    from typing import Literal

    import pydantic

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Oslo"]
        degrees: int

    r = server.client().responses.parse(model="q", input="Weather?", text_format=Weather, temperature=0,
                                        max_output_tokens=200, extra_body=quick_thinking(ids))
    assert isinstance(r.output_parsed, Weather)


def test_a_thinking_cut_short_is_a_reasoning_item(server, ids):
    """The thinking as a reasoning item (streamed: reasoning_text deltas), the response
    incomplete where max_output_tokens cut it, its tokens counted as reasoning."""
    kw = dict(model="q", input="Think.", temperature=0, max_output_tokens=6,
              extra_body={"logit_bias": {str(ids["think"]): 100}, "ignore_eos": True})
    r = server.client().responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].text == THINK * 5
    assert r.usage.output_tokens_details.reasoning_tokens == 6
    with server.client().responses.stream(**kw) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINK * 5
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].text == THINK * 5


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input.0.call_id"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_what_responses_do_not_take_is_refused(server, body, param):
    import httpx

    r = httpx.post(f"{server.url}/v1/responses", json={"model": "q", **body},
                   headers={"Authorization": "Bearer test-key"}, timeout=30)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_the_store_keeps_its_size_and_counts_evictions(server):
    import httpx

    client = server.client()
    made = [client.responses.create(model="q", input="hi", max_output_tokens=1).id for _ in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0])
    assert client.responses.retrieve(made[-1]).id == made[-1]
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("jaxllm:responses_store_evictions_total"))
    assert float(line.split()[-1]) >= 1


# ------------------------------------------------------------------ real clients

def run_agent(url: str, model_name: str, extra_body: dict) -> None:
    """The OpenAI Agents SDK: an agent with two function tools, on its default model (the
    Responses API) and on its chat-completions model; tool_choice required for the
    first turn (the SDK sets it back to auto after a tool call), as a small model needs,
    and a typed final answer (its schema ends the output)."""
    from typing import Literal

    import pydantic
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a time zone."""
        calls.append(("get_time", zone))
        return "12:00"

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(("get_weather", city))
        return "sunny"

    class Answer(pydantic.BaseModel):  # the final answer's shape: a random model's text would never end
        sunny: bool
        time: Literal["12:00", "13:00"]

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0)
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=300,
                             extra_body=extra_body)
    for model in (OpenAIResponsesModel(model_name, client), OpenAIChatCompletionsModel(model_name, client)):
        calls.clear()
        agent = Agent(name="helper", instructions="Use the tools, then answer.", tools=[get_time, get_weather],
                      model=model, model_settings=settings, output_type=Answer)
        result = Runner.run_sync(agent, "What time is it, and is it sunny in Paris?", max_turns=4)
        assert calls and calls[0][0] in ("get_time", "get_weather"), type(model).__name__
        assert isinstance(result.final_output, Answer), type(model).__name__


def test_an_openai_agent_runs_its_tools_to_a_final_answer(server, ids):
    run_agent(server.url, "q", quick_thinking(ids))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("smollm2_agents"), "--max-model-len", "2048", "--kv-cache-memory",
               "64MiB", "--served-model-name", "smol", "--tool-call-parser", "hermes", measure=True)
    yield s
    s.stop()


@pytest.mark.slow  # the real SmolLM2 behind the server
def test_agents_on_the_real_smollm2(smollm2):
    """The agent and LangChain runs on the embedded SmolLM2-135M-Instruct (its template
    shows no tools: required calls are the grammar's)."""
    run_agent(smollm2.url, "smol", {})
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="smol", base_url=f"{smollm2.url}/v1", api_key="test-key", use_responses_api=True,
                     temperature=0, max_tokens=64, max_retries=0)
    assert llm.invoke("What is the capital of France?").text.strip()


def test_langchain_chat_openai_on_the_responses_api(server, ids):
    """LangChain's ChatOpenAI with use_responses_api: a plain answer, bind_tools with a
    required call, and with_structured_output into a pydantic model."""
    from typing import Literal

    import pydantic
    from langchain_openai import ChatOpenAI

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Oslo"]
        degrees: int

    llm = ChatOpenAI(model="q", base_url=f"{server.url}/v1", api_key="test-key", use_responses_api=True,
                     temperature=0, max_tokens=200, max_retries=0, extra_body=quick_thinking(ids))
    assert isinstance(llm.invoke("Hello").text, str)

    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a time zone."""
        return "12:00"

    message = llm.bind_tools([get_time], tool_choice="any").invoke("What time is it?")
    assert [c["name"] for c in message.tool_calls] == ["get_time"]
    assert message.tool_calls[0]["args"]["zone"] in ("utc", "cet")
    weather = llm.with_structured_output(Weather).invoke("Weather in Paris?")
    assert isinstance(weather, Weather)


def test_continue_final_message_and_a_request_template(server, model):
    """continue_final_message renders the last assistant message open (the output goes
    on from its text); a request's own chat_template needs --trust-request-chat-template;
    the refused combinations are 400s naming the field."""
    import httpx

    from jaxllm.engine.input_processor import InputProcessor

    tok = AutoTokenizer.from_pretrained(model)
    history = USER + [{"role": "assistant", "content": "It is twenty"}]
    text = InputProcessor(tok, eos_token_id=None, vocab_size=512, max_model_len=2048).render_chat(
        history, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("It is twenty")  # no end of turn after it
    ok = server.client().chat.completions.create(model="q", messages=history, max_tokens=2, temperature=0,
                                                 extra_body={"continue_final_message": True,
                                                             "add_generation_prompt": False})
    assert ok.choices[0].finish_reason is not None

    def post(body):
        return httpx.post(f"{server.url}/v1/chat/completions", json={"model": "q", "messages": history, **body},
                          headers={"Authorization": "Bearer test-key"}, timeout=30)

    for body, param in (({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
                        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message")):
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
