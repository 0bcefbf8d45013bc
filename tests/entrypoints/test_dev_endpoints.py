"""The server's development endpoints (issue 64; vLLM's under VLLM_SERVER_DEV_MODE): an RL
trainer puts the engine to sleep between rollouts, wakes it, and loads new weights from
a path; the answers after each are the offline engine's for the same weights."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loaders import load_model
from tests.engine.test_update_weights import saved, trained
from tests.support.server import API_KEY, Server, offline_options

BODY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(test_models_dir, shared_cache_dir):
    s = Server(test_models_dir / "llama", shared_cache_dir, "--server-dev-mode", "--enable-sleep-mode",
               "--served-model-name", "tiny", measure=True)  # tests/entrypoints/test_server.py's server's engine
    yield s
    s.stop()


def call(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                         **kw)


def text(server) -> str:
    r = call(server, "POST", "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def offline(server, folder) -> LLM:
    """An engine of the server's options and cache (its executables: nothing compiled)."""
    return LLM(str(folder), **offline_options(server))


def test_sleep_wake_and_weights_from_a_path(server, test_models_dir, tmp_path):
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    before = text(server)
    assert call(server, "POST", "/sleep", params={"level": "1"}).status_code == 200
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    asleep = call(server, "POST", "/v1/completions", json=BODY)
    assert asleep.status_code == 400 and "asleep" in asleep.json()["error"]["message"]
    assert call(server, "POST", "/wake_up").status_code == 200
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    assert text(server) == before
    folder = saved(test_models_dir, tmp_path, trained(load_model(test_models_dir / "llama", dtype="float32").params))
    assert call(server, "POST", "/update_weights", json={"path": str(folder)}).status_code == 200
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = offline(server, folder).generate(BODY["prompt"], params, use_tqdm=False)[0].outputs[0].text
    assert text(server) == want != before
    wrong = call(server, "POST", "/update_weights", json={"path": str(test_models_dir / "qwen3")})
    assert wrong.status_code == 400 and "the engine's" in wrong.json()["error"]["message"], wrong.text
    assert call(server, "POST", "/reset_prefix_cache").status_code == 200
    assert call(server, "POST", "/sleep", params={"level": "3"}).status_code == 400
    assert httpx.post(f"{server.url}/sleep").status_code == 401  # behind the API key like the API


def stream(server, **body) -> tuple[str, str | None, int]:
    """A streamed completion: its text, finish_reason and number of tokens."""
    text, reason, tokens = "", None, None
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json=BODY | body | {"stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    reason = chunk["choices"][0]["finish_reason"] or reason
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return text, reason, tokens


def running_now(server) -> float:
    metrics = call(server, "GET", "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def test_pause_modes_and_resume(server, test_models_dir, tmp_path):
    """vLLM's /pause modes: a request that arrives while paused waits for /resume (and
    across a weight update, answers with the new weights); abort ends it; wait returns
    once what ran has finished."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    assert call(server, "POST", "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert call(server, "GET", "/is_paused").json() == {"is_paused": True}
    held = pool.submit(stream, server)
    with pytest.raises(concurrent.futures.TimeoutError):
        held.result(timeout=1.0)  # nothing runs while paused
    folder = saved(test_models_dir, tmp_path, trained(load_model(test_models_dir / "llama", dtype="float32").params, 5))
    assert call(server, "POST", "/update_weights", json={"path": str(folder)}).status_code == 200
    assert call(server, "POST", "/resume").json() == {"status": "resumed"}
    want = offline(server, folder).generate(BODY["prompt"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert held.result(timeout=60) == (want, "length", 8)

    call(server, "POST", "/pause", params={"mode": "keep"})
    aborted = pool.submit(stream, server)
    with pytest.raises(concurrent.futures.TimeoutError):
        aborted.result(timeout=0.5)
    assert call(server, "POST", "/pause", params={"mode": "abort"}).status_code == 200
    assert aborted.result(timeout=60)[1:] == ("abort", 0)
    call(server, "POST", "/resume")

    running = pool.submit(stream, server, max_tokens=200)
    time.sleep(0.2)
    assert call(server, "POST", "/pause", params={"wait_for_inflight_requests": "true"}).status_code == 200
    assert running_now(server) == 0  # it finished before the pause answered
    assert running.result(timeout=60)[1:] == ("length", 200)
    call(server, "POST", "/resume")
    assert call(server, "GET", "/is_paused").json() == {"is_paused": False}

    bad = call(server, "POST", "/pause", params={"mode": "later"})
    assert bad.status_code == 400 and "mode: unknown 'later'" in bad.json()["error"]["message"]
    bad = call(server, "POST", "/pause", params={"clear_cache": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "clear_cache"
    assert call(server, "GET", "/is_paused").json() == {"is_paused": False}
