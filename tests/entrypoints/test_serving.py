"""entrypoints/openai/serving.py against a stand-in engine: what the HTTP layer makes of
engine outputs, without a server."""

import asyncio

from jaxllm.entrypoints.openai import serving
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams


class Engine:
    """Answers every request with one token "x"; remembers the request ids."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    async def generate(self, request_id, prompt_ids, params, output_kind, lora_request=None):
        self.request_ids.append(request_id)
        yield RequestOutput(request_id, None, prompt_ids, [CompletionOutput(0, "x", [7], finish_reason="length")],
                            finished=True)


def test_one_id_from_the_engine_to_the_response():
    """The response's id is the one the engine ran the request under (its jobs' prefix),
    so logs, metrics and aborts name what the client saw."""
    engine = Engine()
    jobs = [serving.Job("cmpl-abc-0", [1, 2], "p", 0), serving.Job("cmpl-abc-1", [3], "q", 1)]
    shape = serving.CompletionShape(engine, echo=False, num_logprobs=None, num_prompt_logprobs=None)
    body = asyncio.run(serving.completions(engine, "cmpl-abc", jobs, SamplingParams(max_tokens=1), model="m",
                                           shape=shape, stream=False, include_usage=False))
    assert body["id"] == "cmpl-abc" and sorted(engine.request_ids) == ["cmpl-abc-0", "cmpl-abc-1"]
    assert [c["text"] for c in body["choices"]] == ["x", "x"]
    job = serving.Job("chatcmpl-def", [1], "p", 0)
    body = asyncio.run(serving.chat(engine, job, SamplingParams(max_tokens=1), model="m", stream=False,
                                    include_usage=False, num_top_logprobs=0))
    assert body["id"] == "chatcmpl-def" == engine.request_ids[-1]


class AdmittingEngine:
    """What the handlers' checks read from an engine."""

    def __init__(self, unfinished: int, healthy: bool = True) -> None:
        self.num_unfinished_sequences, self._healthy, self.dead_reason = unfinished, healthy, None

    def is_healthy(self) -> bool:
        return self._healthy


def test_handlers_admit_by_sequences_without_a_server():
    import pytest

    from jaxllm.entrypoints.openai.api_server import Handlers, ServerSettings
    from jaxllm.entrypoints.openai.errors import APIError

    settings = ServerSettings(model_name="m", max_num_seqs=4, max_waiting_requests=4)  # 8 sequences at once
    Handlers(AdmittingEngine(unfinished=5), settings).admit(3)
    with pytest.raises(APIError) as full:
        Handlers(AdmittingEngine(unfinished=6), settings).admit(3)
    assert full.value.status == 503
    with pytest.raises(APIError) as never:
        Handlers(AdmittingEngine(unfinished=0), settings).admit(9)
    assert never.value.status == 400 and never.value.param == "n"
    with pytest.raises(APIError) as dead:
        Handlers(AdmittingEngine(unfinished=0, healthy=False), settings).admit(1)
    assert dead.value.status == 503


def test_cors_is_off_unless_origins_are_given():
    """--allowed-origins: a browser's preflight gets Starlette's CORS headers (before the
    API key check: a preflight carries none); without it, no CORS header at all."""
    from starlette.testclient import TestClient

    from jaxllm.entrypoints.openai.api_server import CORS, ServerSettings, build_app

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    on = TestClient(build_app(None, ServerSettings(model_name="m", api_key="k",
                                                   cors=CORS(allowed_origins=("https://app.example",)))))
    r = on.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert on.post("/v1/chat/completions", json={}).status_code == 401  # the key is still asked for
    off = TestClient(build_app(None, ServerSettings(model_name="m", api_key="k")))
    assert "access-control-allow-origin" not in off.options("/v1/chat/completions", headers=preflight).headers


def test_several_api_keys_each_open_the_routes():
    """--api-key given twice: either key passes (a missing route is then a 404, not a
    401); any other is refused."""
    from starlette.testclient import TestClient

    from jaxllm.entrypoints.openai.api_server import ServerSettings, build_app
    from jaxllm.serve import parse_args

    assert parse_args(["--api-key", "k1", "--api-key", "k2"]).api_key == ("k1", "k2")
    assert parse_args(["--api-key", "k1"]).api_key == "k1"
    client = TestClient(build_app(None, ServerSettings(model_name="m", api_key=("k1", "k2"))))
    for key, status in (("k1", 404), ("k2", 404), ("k3", 401), ("", 401)):
        assert client.post("/v1/no-such-route", headers={"Authorization": f"Bearer {key}"}).status_code == status
