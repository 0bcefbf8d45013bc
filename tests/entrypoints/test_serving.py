"""entrypoints/openai/serving.py against a stand-in engine: what the HTTP layer makes of
engine outputs, without a server."""

import asyncio

import pytest

from jaxllm.entrypoints.openai import serving
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams


class Engine:
    """Answers every request with one token "x"; remembers the request ids."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    async def generate(self, request_id, prompt_ids, params, output_kind, lora_request=None, cache_salt=None,
                       priority=0, images=()):
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
                                    include_usage=False, shape=serving.ChatShape()))
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
    open_ = TestClient(build_app(None, ServerSettings(model_name="m", api_key="")))  # $JAXLLM_API_KEY="": no key
    assert open_.post("/v1/no-such-route").status_code == 404


def test_tls_and_a_root_path_reach_uvicorn(tmp_path):
    """--ssl-keyfile/--ssl-certfile (a self-signed certificate made here) and --root-path
    as uvicorn serves them: a client that trusts the certificate gets answers over
    HTTPS; behind the root path (a proxy strips it, uvicorn puts it back in the path)
    the API key is still asked for."""
    import datetime
    import threading
    import time

    import httpx
    import uvicorn
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from jaxllm.entrypoints.openai.api_server import ServerSettings, build_app
    from jaxllm.serve import parse_args, uvicorn_config
    from tests.support.server import free_port

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address(
                "127.0.0.1"))]), critical=False).sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    port = free_port()
    args = parse_args(["--port", str(port), "--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile",
                       str(tmp_path / "cert.pem"), "--root-path", "/llm", "--api-key", "k"])
    server = uvicorn.Server(uvicorn_config(build_app(None, ServerSettings(model_name="m", api_key="k")), args))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(verify=str(tmp_path / "cert.pem")) as client:
            r = client.post(f"https://127.0.0.1:{port}/v1/no-route", headers={"Authorization": "Bearer k"})
            assert r.status_code == 404 and r.json()["error"]["message"].startswith("no route POST /llm/v1/no-route")
            assert client.post(f"https://127.0.0.1:{port}/v1/no-route").status_code == 401
        with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # plain HTTP is not spoken
            httpx.post(f"http://127.0.0.1:{port}/v1/no-route", timeout=5)
    finally:
        server.should_exit = True
        thread.join(10)


def test_request_logs_and_request_id_headers(caplog):
    """--enable-log-requests logs a request's prompt cut to --max-log-len (nothing
    without it); --enable-request-id-headers answers with the client's X-Request-Id or a
    new one."""
    import logging

    from starlette.testclient import TestClient

    from jaxllm.entrypoints.openai.api_server import Handlers, ServerSettings, build_app
    from jaxllm.serve import parse_args

    assert parse_args(["--disable-log-requests"]).enable_log_requests is False  # vLLM's old flag: accepted
    with caplog.at_level(logging.INFO, logger="jaxllm.entrypoints.openai.api_server"):
        Handlers(None, ServerSettings(model_name="m")).log_request("r0", "secret prompt", SamplingParams())
        Handlers(None, ServerSettings(model_name="m", log_requests=True, max_log_len=6)).log_request(
            "r1", "secret prompt", SamplingParams(max_tokens=3))
    (record,) = [r for r in caplog.records if "Received request" in r.getMessage()]
    assert "r1" in record.getMessage() and "'secret'" in record.getMessage() and "prompt'" not in record.getMessage()
    client = TestClient(build_app(None, ServerSettings(model_name="m", request_id_headers=True)))
    assert client.get("/v1/nope", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"
    assert len(client.get("/v1/nope").headers["x-request-id"]) == 32
    assert "x-request-id" not in TestClient(build_app(None, ServerSettings(model_name="m"))).get("/v1/nope").headers
