"""The OpenAI-compatible server, for real: `python -m jaxllm.serve` on 127.0.0.1 with
a tiny test model, driven by the `openai` client (sync and async) and httpx."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.llm import LAZY
from tests.support.server import API_KEY, Server


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def core_pid(server_pid: int) -> int:
    for pid in children_of(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError("no engine core process")


@pytest.fixture(scope="module")
def cache_dir(shared_cache_dir) -> Path:
    """The run's compilation cache: the module's servers and offline engine share one
    another's executables, and the main server those of the other tests' servers of its
    options (tests/support/server.py)."""
    return shared_cache_dir


@pytest.fixture(scope="module")
def server(test_models_dir, cache_dir):
    s = Server(test_models_dir / "llama", cache_dir, "--max-waiting-requests", "64", "--served-model-name", "tiny",
               "--tool-call-parser", "hermes", measure=True)
    yield s
    s.stop()


def metric(server: Server, name: str) -> float:
    """A series' value, summed over its label sets (finished_reason, engine)."""
    text = httpx.get(f"{server.url}/metrics").text
    values = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert values, name
    return sum(map(float, values))


def wait_idle(server: Server, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("engine did not return to idle")


# ------------------------------------------------------------------ happy paths

def test_startup_output(server):
    out = server.output()
    assert re.search(r"model llama loaded in [\d.]+ s; dtype float32 \(auto: the checkpoint's float32\); "
                     r"KV cache \(float32, auto: the model's dtype\): \d+ blocks of 16 tokens = \d+ tokens", out)
    assert "compiling buckets" in out and re.search(r"; compiled in [\d.]+ s\n", out)  # warmed up, as a user's
    assert f"serving tiny at http://127.0.0.1:{server.port}/v1" in out


def test_a_model_that_is_not_there_exits_with_its_message_alone(tmp_path):
    """Bad input found at start-up (here a model path that does not exist; a checkpoint
    jaxllm cannot hold alike): the server exits 1 with one `error:` naming it, no
    tracebacks from the engine core process and the frontend."""
    missing = tmp_path / "no-such-model"
    run = subprocess.run([sys.executable, "-m", "jaxllm.serve", "--model", str(missing), "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=os.environ | {"JAXLLM_API_KEY": ""})
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    assert run.stderr.count(f"FileNotFoundError: {missing}: no such model file or folder") == 1, run.stderr
    assert run.stderr.startswith("error: engine core failed during start-up"), run.stderr


def test_completions_and_usage(server):
    client = server.client()
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == "tiny" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == len(httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"},
                                                   headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"])
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny", prompt="Hello world", max_tokens=7, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    # a long shared prefix is served from the prefix cache
    long = "The quick brown fox jumps over the lazy dog. " * 6
    client.completions.create(model="tiny", prompt=long + "A", max_tokens=2)
    hit = client.completions.create(model="tiny", prompt=long + "B", max_tokens=2)
    assert hit.usage.prompt_tokens_details.cached_tokens >= 32
    # cache_salt: the same prefix shares blocks only within one salt (tenant isolation)
    salted = [client.completions.create(model="tiny", prompt=long + end, max_tokens=2,
                                        extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens
              for salt, end in (("tenant-a", "C"), ("tenant-b", "D"), ("tenant-a", "E"))]
    assert salted[0] == 0 and salted[1] == 0 and salted[2] >= 32
    # several prompts, token-id prompts, n=2, echo
    r = client.completions.create(model="tiny", prompt=["One", "Two"], n=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens == 12
    ids = [5, 6, 7, 8]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, echo=True, temperature=0)
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": ids},
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()["prompt"]
    assert r.choices[0].text.startswith(detok)


def test_logprobs_stop_and_seed(server):
    client = server.client()
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the sampled token is the most likely one among the alternatives
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in "".join(lp.tokens)
    # stop string: text ends before it
    full = client.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
    # seeds: same seed same text, sampled
    kw = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=3, **kw).choices[0].text
    b = client.completions.create(seed=3, **kw).choices[0].text
    c = client.completions.create(seed=4, **kw).choices[0].text
    assert a == b != c


def test_chat_and_streaming_with_usage(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 5 and len(r.choices[0].logprobs.content) == 5
    assert all(len(c.top_logprobs) == 2 for c in r.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    # completions streaming, n=2
    stream = client.completions.create(model="tiny", prompt="Hello", n=2, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 8


def test_streamed_chat_logprobs_cover_every_token(server):
    """Tokens whose text the detokenizer holds back (a partial UTF-8 character) still
    stream their logprobs: the streamed entries equal the non-streamed ones."""
    body = {"messages": [{"role": "user", "content": "Lazy grass near stories lazy brown"}], "max_tokens": 15,
            "ignore_eos": True, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert len(whole) == 15
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-4)


def test_async_client(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        rs = await asyncio.gather(*[client.completions.create(model="tiny", prompt=f"Number {i}", max_tokens=6,
                                                              temperature=0, extra_body={"ignore_eos": True})
                                    for i in range(6)])
        await client.close()
        return rs

    for r in asyncio.run(run()):
        assert r.usage.completion_tokens == 6


def test_open_endpoints_and_tokenize(server):
    assert post(server, "/sleep").status_code == 404  # development endpoints: off by default
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    assert "vllm:num_requests_running" in httpx.get(f"{server.url}/metrics").text
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=auth)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 3


# ------------------------------------------------------- scoring (lm-eval's path)

@pytest.fixture(scope="module")
def offline(server, test_models_dir, cache_dir):
    """The same model offline, with the server's shapes (its executables load from the
    server's store): the oracle for what the server returns."""
    from jaxllm import LLM
    return LLM(str(test_models_dir / "llama"), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
               kv_cache_memory="4MiB", compilation_cache_dir=str(cache_dir), progress=False, **LAZY)


def offline_scores(offline, ids: list[int], k: int, max_tokens: int = 1):
    from jaxllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k, ignore_eos=True)
    return offline.generate([ids], params, use_tqdm=False)[0]


def assert_echo_scores(lp: dict, ids: list[int], want, k: int) -> None:
    """An echoed prompt's logprobs (then the generated tokens') equal the offline ones."""
    n = len(ids)
    generated = want.outputs[0]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + len(generated.token_ids)
    entries = want.prompt_logprobs[1:] + generated.logprobs
    for i, (token, entry) in enumerate(zip(ids[1:] + generated.token_ids, entries), start=1):
        assert lp["token_logprobs"][i] == pytest.approx(entry[token].logprob, abs=1e-4)
        top = {lp_.decoded_token for t, lp_ in entry.items() if t == token or lp_.rank <= k}
        assert set(lp["top_logprobs"][i]) == top
        assert lp["tokens"][i] == entry[token].decoded_token
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"]))


# The series vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json
# in vllm-project/vllm) queries, each filtered by model_name; and the rest of vLLM's
# request histograms.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
VLLM_HISTOGRAMS = [
    "request_time_per_output_token_seconds", "request_inference_time_seconds", "request_params_n",
    "request_params_max_tokens", "iteration_tokens_total",
]


def series(server: Server) -> dict[tuple[str, frozenset], float]:
    """/metrics as (name, labels) -> value."""
    out = {}
    for name, labels, value in re.findall(r"^([\w:]+)\{([^}]*)\} (\S+)$", httpx.get(f"{server.url}/metrics").text,
                                          re.M):
        out[name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return out


def test_vllm_dashboard_series_after_traffic(server):
    """Every series vLLM's Grafana dashboard queries exists under vLLM's name with the
    model_name and engine labels, and the counters and histograms moved by what the
    client saw: tokens, finish reasons per returned sequence, one latency sample per
    request, n and max_tokens."""
    wait_idle(server)
    before = series(server)
    client = server.client()
    answers = [client.completions.create(model="tiny", prompt="Count: one two", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}),
               client.completions.create(model="tiny", prompt="Colors: red", max_tokens=4, n=2, temperature=1,
                                         seed=3, extra_body={"ignore_eos": True}),
               client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True})]
    wait_idle(server)
    after = series(server)
    labels = {("model_name", "tiny"), ("engine", "0")}
    for name in DASHBOARD_SERIES + [f"vllm:{h}_{part}" for h in VLLM_HISTOGRAMS for part in ("bucket", "sum", "count")]:
        assert any(n == name and labels <= ls for n, ls in after), name

    def delta(name: str, **extra) -> float:
        keys = [k for k in after if k[0] == name and labels | set(extra.items()) <= k[1]]
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    prompt = sum(a.usage.prompt_tokens for a in answers)
    generated = sum(a.usage.completion_tokens for a in answers)
    assert generated == 5 + 8 + 6
    assert delta("vllm:prompt_tokens_total") == delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:generation_tokens_total") == delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:request_success_total") == 4
    assert delta("vllm:request_max_num_generation_tokens_sum") == 5 + 4 + 6
    assert delta("vllm:request_params_n_sum") == 1 + 2 + 1
    assert delta("vllm:request_params_max_tokens_sum") == 5 + 4 + 6
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{name}_count") == 3, name
        assert delta(f"vllm:{name}_bucket", le="+Inf") == 3, name
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    parts = delta("vllm:request_queue_time_seconds_sum") + delta("vllm:request_inference_time_seconds_sum")
    assert 0 < parts <= e2e + 1e-6
    assert delta("vllm:request_decode_time_seconds_sum") <= delta("vllm:request_inference_time_seconds_sum")
    # a sequence's outputs after its first: at least one gap each (tokens come in steps of up to 4)
    assert delta("vllm:inter_token_latency_seconds_count") >= 4
    assert delta("vllm:iteration_tokens_total_sum") >= generated - 4  # each token but a sequence's last is fed back
    assert after["vllm:num_requests_running", frozenset(labels)] == 0


def test_jaxllm_chat_and_complete_talk_to_the_server(server):
    """`jaxllm chat` / `jaxllm complete` (vLLM's terminal clients): each answer, streamed,
    is what the API gives for the same request; chat keeps the conversation."""
    client = server.client()
    flags = ["--url", f"{server.url}/v1", "--api-key", API_KEY, "--max-tokens", "6", "--temperature", "0"]

    def jaxllm(*args, stdin=None):
        run = subprocess.run([sys.executable, "-m", "jaxllm.cli", *args, *flags], input=stdin, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stdout

    ask = dict(model="tiny", max_tokens=6, temperature=0)
    first = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **ask).choices[0].message
    assert jaxllm("chat", "-q", "Hi") == first.content + "\n"
    second = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": first.content},
                                                      {"role": "user", "content": "More"}], **ask)
    assert jaxllm("chat", stdin="Hi\nMore\n") == f"> {first.content}\n> {second.choices[0].message.content}\n> "
    texts = [client.completions.create(prompt=p, **ask).choices[0].text for p in ("One", "Two")]
    assert jaxllm("complete", stdin="One\nTwo\n") == "".join(f"> {t}\n" for t in texts) + "> "
    run = subprocess.run([sys.executable, "-m", "jaxllm.cli", "chat", "-q", "Hi", "--url", f"{server.url}/v1",
                          "--api-key", "wrong"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr.startswith("error: 401")


def test_echo_logprobs_score_the_prompt(server, offline):
    text = "The quick brown fox jumps over the lazy dog, then naps."
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    want = offline_scores(offline, ids, 2)
    for prompt in (ids, text, [ids]):
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprobs": 2, "echo": True,
                                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == text + want.outputs[0].text
        assert_echo_scores(choice["logprobs"], ids, want, 2)
    # max_tokens 0: the prompt scored, nothing generated (what older lm-eval versions send)
    r = post(server, "/v1/completions", {"prompt": [ids], "max_tokens": 0, "logprobs": 1, "echo": True})
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert_echo_scores(choice["logprobs"], ids, offline_scores(offline, ids, 1, max_tokens=0), 1)
    # without logprobs: the engine still scores the prompt (max_tokens 0 needs it), the response shows none
    r = post(server, "/v1/completions", {"prompt": [ids], "max_tokens": 0, "echo": True})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["text"] == text and choice["logprobs"] is None
    assert "prompt_logprobs" not in choice
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]


def test_echo_logprobs_with_n_several_prompts_and_streaming(server, offline):
    a = post(server, "/tokenize", {"prompt": "Paris is the capital of"}).json()["tokens"]
    b = post(server, "/tokenize", {"prompt": "One, two, three, four, five, six"}).json()["tokens"]
    body = {"prompt": [a, b], "n": 2, "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0,
            "ignore_eos": True}
    choices = sorted(post(server, "/v1/completions", body).json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for ids, pair in ((a, choices[:2]), (b, choices[2:])):
        want = offline_scores(offline, ids, 1, max_tokens=3)
        for choice in pair:
            assert_echo_scores(choice["logprobs"], ids, want, 1)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    merged = {}
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            m = merged.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []})
            m["text"] += c["text"]
            for key in ("tokens", "token_logprobs", "text_offset"):
                m[key] += c["logprobs"][key]
    for choice in choices:
        m = merged[choice["index"]]
        assert m["text"] == choice["text"] and m["tokens"] == choice["logprobs"]["tokens"]
        assert m["text_offset"] == choice["logprobs"]["text_offset"]
        assert m["token_logprobs"][0] is None
        assert m["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-4)


def test_prompt_logprobs_field(server, offline):
    ids = post(server, "/tokenize", {"prompt": "Hello there, how are you today?"}).json()["tokens"]
    want = offline_scores(offline, ids, 2)
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        entry = got[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(want.prompt_logprobs[p][ids[p]].logprob, abs=1e-4)
        assert entry["rank"] == want.prompt_logprobs[p][ids[p]].rank
        assert {int(t) for t, e in got[p].items() if e["rank"] <= 2} >= {
            t for t, e in want.prompt_logprobs[p].items() if e.rank <= 2}
    messages = [{"role": "user", "content": "hi"}]
    n = post(server, "/tokenize", {"messages": messages}).json()["count"]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0})
    got = r.json()["prompt_logprobs"]
    assert got[0] is None and len(got) == n and all(len(e) == 1 for e in got[1:])
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "stop_token_ids": [5]})
    assert r.status_code == 200


def stream_choices(server, path: str, body: dict) -> dict[int, dict]:
    """A streamed response's chunks merged per choice index: text (or chat content),
    finish_reason."""
    with httpx.stream("POST", f"{server.url}{path}", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    merged: dict[int, dict] = {}
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            m = merged.setdefault(c["index"], {"text": "", "finish_reason": None})
            m["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            m["finish_reason"] = c["finish_reason"] or m["finish_reason"]
    return merged


def test_vllm_request_fields(server, offline):
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens give the offline
    engine's tokens; return_tokens_as_token_ids names tokens "token_id:N"; chat's echo
    starts the answer with the assistant's last message; a non-text content part is a
    400 naming its type."""
    from jaxllm import SamplingParams

    ids = list(range(10, 80))
    fields = {"allowed_token_ids": [5, 17, 99, 250], "bad_words": ["the", "ing"], "truncate_prompt_tokens": 20}
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **fields),
                            use_tqdm=False)[0]
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                         "logprobs": 2, "return_tokens_as_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]
    assert got["tokens"] == [f"token_id:{t}" for t in want.outputs[0].token_ids]
    assert set(want.outputs[0].token_ids) <= set(fields["allowed_token_ids"])
    assert r.json()["usage"]["prompt_tokens"] == 20
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "Hello"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", body | {"echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Hello" + plain
    chunks = stream_choices(server, "/v1/chat/completions", body | {"echo": True})
    assert chunks[0]["text"] == echoed
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]})
    assert r.status_code == 400 and "'image_url' is not supported" in r.json()["error"]["message"], r.text
    chat = post(server, "/v1/chat/completions", {"messages": messages[:1], "max_tokens": 3, "logprobs": True,
                                                 "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_beam_search_on_both_endpoints(server, offline):
    """use_beam_search with n as the width (vLLM's extras): n choices, best first, the
    offline engine's beams; usage counts the returned sequences; a stream sends them
    when the search ends."""
    from jaxllm.sampling_params import BeamSearchParams

    text = "The quick brown fox"
    want = offline.beam_search(text, BeamSearchParams(3, 6, length_penalty=0.5))[0].sequences
    body = {"prompt": text, "use_beam_search": True, "n": 3, "max_tokens": 6, "length_penalty": 0.5}
    wait_idle(server)
    finished, generated = (metric(server, f"vllm:{m}_total") for m in ("request_success", "generation_tokens"))
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [s.output_text for s in want]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in want]
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == sum(len(s.output_token_ids) for s in want)
    assert metric(server, "vllm:request_success_total") == finished + 3  # its returned sequences, and their tokens
    assert metric(server, "vllm:generation_tokens_total") == generated + usage["completion_tokens"]
    streamed = stream_choices(server, "/v1/completions", body)
    assert [streamed[i]["text"] for i in range(3)] == [s.output_text for s in want]
    messages = [{"role": "user", "content": "Name a color."}]
    want = offline.beam_search(messages, BeamSearchParams(2, 5))[0].sequences
    body = {"messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 5}
    r = post(server, "/v1/chat/completions", body)
    assert [c["message"]["content"] for c in r.json()["choices"]] == [s.output_text for s in want]
    streamed = stream_choices(server, "/v1/chat/completions", body)
    assert [streamed[i]["text"] for i in range(2)] == [s.output_text for s in want]
    wait_idle(server)


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
    ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 12}, "n"),  # more than the server's max_num_seqs (8)
    ({"use_beam_search": True, "n": 17}, "n"),  # more than a beam search ranks
    ({"use_beam_search": True, "n": 2, "presence_penalty": 0.5}, "presence_penalty"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": {"on": True}}, "use_beam_search"),
])
def test_bad_beam_searches_are_400(server, body, param):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/score", "/rerank"])
def test_a_generating_server_answers_pooling_endpoints_with_how_to_start_one(server, path):
    body = {"/score": {"text_1": "a", "text_2": "b"}, "/rerank": {"query": "a", "documents": ["b"]}}.get(
        path, {"input": "hello"})
    r = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text


def test_tokenizer_info_round_trips(server, test_models_dir, tmp_path):
    """What lm-eval's tokenizer_backend=remote reads: enough to rebuild the tokenizer
    from its vocabulary file alone (special tokens, chat template)."""
    import shutil

    from transformers import AutoTokenizer

    r = httpx.get(f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401
    info = r.json()
    shutil.copy(test_models_dir / "llama" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(info))
    rebuilt = AutoTokenizer.from_pretrained(tmp_path)
    original = AutoTokenizer.from_pretrained(test_models_dir / "llama")
    for name in ("bos_token", "eos_token", "pad_token", "chat_template"):
        assert getattr(rebuilt, name) == getattr(original, name), name
    messages = [{"role": "user", "content": "Hi there"}]
    assert rebuilt.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)
    assert rebuilt.encode("The lazy dog") == original.encode("The lazy dog")


# ---------------------------------------------------------------- structured outputs

def test_chat_parse_with_a_pydantic_response_format(server):
    """The openai client's `parse(response_format=Model)` works unchanged."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)
        pet: typing.Literal["cat", "dog"]

    client = server.client()
    for seed in range(3):
        r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Who?"}],
                                          response_format=Person, temperature=0.8, seed=seed, max_tokens=200)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop" and isinstance(message.parsed, Person), message.content
        assert Person.model_validate_json(message.content) == message.parsed


def test_regex_choice_grammar_fields_and_streaming(server):
    """vLLM's structured_outputs field, its older guided_* names, n = 2 and streaming."""
    client = server.client()
    r = client.completions.create(model="tiny", prompt="Code:", max_tokens=30, n=2, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert len(r.choices) == 2 and all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.text) for c in r.choices)
    r = client.completions.create(model="tiny", prompt="Pick:", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["left", "right", "up"]})
    assert r.choices[0].text in ("left", "right", "up") and r.choices[0].finish_reason == "stop"
    grammar = 'root ::= "(" [a-c] ("," [a-c]){0,3} ")"'
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "List"}],
                                          max_tokens=20, seed=3, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([a-c](,[a-c]){0,3}\)", chat.choices[0].message.content)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Json"}], max_tokens=200, seed=4, stream=True,
        extra_body={"structured_outputs": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                    "required": ["ok"], "additionalProperties": False}}})
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(text)["ok"], bool), text


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_required_and_named_tool_calls_follow_the_schemas(server):
    import jsonschema

    client = server.client()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="required", parallel_tool_calls=False, seed=seed,
                                           max_tokens=200)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id and call.type == "function"
    named = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=200, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])


def test_streamed_tool_calls_reassemble_into_the_same_call(server):
    client = server.client()
    messages = [{"role": "user", "content": "Time?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(model="tiny", messages=messages, tools=[TIME_TOOL], tool_choice=tool_choice, max_tokens=200,
                  temperature=0.8, seed=5, parallel_tool_calls=False)
        whole = client.chat.completions.create(**kw).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        name, arguments = None, ""
        for chunk in chunks:
            for d in chunk.delta.tool_calls or []:
                assert d.index == 0
                name = d.function.name or name
                arguments += d.function.arguments or ""
        assert (name, json.loads(arguments)) == (whole.message.tool_calls[0].function.name,
                                                 json.loads(whole.message.tool_calls[0].function.arguments))
        assert chunks[-1].finish_reason == whole.finish_reason


def test_auto_tool_calls_are_parsed_and_a_tool_result_continues(server):
    """tool_choice auto with the hermes parser (an output forced into its format by a
    regex, since a random model writes none); then the conversation goes on with the
    tool's result, which the chat template renders."""
    client = server.client()
    call_re = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "[A-Z][a-z]{2,6}", "unit": "c"\\}\\}\n</tool_call>'
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL],
              max_tokens=150, temperature=0, extra_body={"structured_outputs": {"regex": "Sure\\. " + call_re}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] == "c"
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    streamed = [d for c in chunks for d in c.delta.tool_calls or []]
    assert content.strip() == "Sure." and chunks[-1].finish_reason == "tool_calls"
    # the call as it is generated: its id and name first, then its arguments in pieces
    assert streamed[0].id and streamed[0].function.name == "get_weather" and len(streamed) > 2
    assert {d.index for d in streamed} == {0} and all(d.id is None for d in streamed[1:])
    assert json.loads("".join(d.function.arguments or "" for d in streamed)) == args
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}]
    rendered = post(server, "/tokenize", {"messages": history}).json()
    text = post(server, "/detokenize", {"tokens": rendered["tokens"]}).json()["prompt"]
    assert "21 degrees and sunny" in text
    after = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                           max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 5 and after.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= ("}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_400_and_the_engine_keeps_serving(server, body, param):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


# ------------------------------------------------------------------------ errors

def post(server, path, body=None, *, content=None, key=API_KEY, headers=None, timeout=30):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=h | (headers or {}), timeout=timeout)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "tools": []}, "tools"),
    ({"prompt": "hi " * 300}, "prompt"),
    ({"prompt": [1, 10**7]}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "hi", "priority": 1}, "priority"),  # the server schedules first come, first served
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
])
def test_bad_requests_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_max_tokens_beyond_the_context_is_400(server):
    """As vLLM: the prompt plus max_tokens must fit the context; absent means "up to it"."""
    messages = [{"role": "user", "content": "hi"}]
    n = post(server, "/tokenize", {"messages": messages}).json()["count"]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 10**9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"].startswith(
        f"This model's maximum context length is 256 tokens. However, you requested {n + 10**9} tokens "
        f"({n} in the messages, {10**9} in the completion)")
    ok = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 256 - n})
    assert ok.status_code == 200
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 257 - n})
    assert r.status_code == 400
    r = post(server, "/v1/chat/completions", {"messages": messages, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256 - n  # up to the context


def test_non_streaming_client_that_leaves_is_aborted(server):
    """A client that stops waiting for a non-streamed completion frees its slots and stops
    costing steps: the engine goes idle, having generated far fewer tokens than asked."""
    import concurrent.futures

    wait_idle(server)
    before = metric(server, "vllm:generation_tokens_total")
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}

    def leave() -> None:
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", body, timeout=0.02)  # well before all 240 tokens, in steps of 4 too

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: leave(), range(8)))
    wait_idle(server)
    generated = metric(server, "vllm:generation_tokens_total") - before
    assert generated < 8 * 240, generated  # all 8 run to the end if nobody aborts them


def test_error_codes(server):
    r = post(server, "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.role")
    assert post(server, "/v1/completions", {"prompt": "hi"}, key=None).status_code == 401
    r = post(server, "/v1/completions", {"prompt": "hi"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(server, "/tokenize", {"prompt": "hi"}, key=None).status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    r = post(server, "/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = post(server, "/v1/completions", {"prompt": "x" * (17 * 2**20)})
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body exceeds")
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny", prompt="hi", temperature=5)
    # and the server still serves
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


# --------------------------------------------------------- concurrency and aborts

def test_64_streaming_clients_with_disconnects(server):
    rng = random.Random(0)
    plan = [(i, rng.randint(20, 60), i % 3 == 0) for i in range(64)]  # every third disconnects

    async def one(client: httpx.AsyncClient, i: int, max_tokens: int, leave: bool):
        body = {"model": "tiny", "prompt": f"Client {i} says", "max_tokens": max_tokens, "temperature": 0.8,
                "seed": i, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        leave_after = rng.randint(1, 10)
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line and '"choices": []' in line:
                    return ("usage", line)
                if line.startswith("data: {"):
                    chunks += 1
                    if leave and chunks >= leave_after:
                        return ("left", None)
        return ("ended", None)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as client:
            return await asyncio.gather(*[one(client, *p) for p in plan])

    results = asyncio.run(run())
    for (i, max_tokens, leave), (kind, line) in zip(plan, results):
        if not leave:
            assert kind == "usage", (i, kind)
            assert f'"completion_tokens": {max_tokens}' in line
    wait_idle(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_queue_full_is_503_and_server_recovers(test_models_dir, cache_dir):
    # the step shapes of test_dead_engine_core's server (single decode steps), which then loads them
    s = Server(test_models_dir / "llama", cache_dir, "--max-waiting-requests", "0", "--max-model-len", "1024",
               "--num-scheduler-steps", "1", api_key=None)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
                body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
                busy = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(7)]
                while metric(s, "vllm:num_requests_running") < 7:
                    await asyncio.sleep(0.05)
                # admission counts sequences: n=2 needs two of the one place left
                two = await client.post("/v1/completions", json=body | {"n": 2})
                one = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                extra = await client.post("/v1/completions", json=body)
                done = await asyncio.gather(*busy)
                return two, one, extra, done

        two, one, extra, done = asyncio.run(run())
        assert two.status_code == 503 and two.headers["retry-after"] and one.status_code == 200
        assert extra.status_code == 200  # the place freed by `one`
        assert all(r.status_code == 200 for r in done)
        too_many = httpx.post(f"{s.url}/v1/completions", json={"prompt": ["Hi", "Ho"], "n": 5, "max_tokens": 1})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200

        # SIGTERM with a request in flight: the server exits, the core with it
        server_pid, core = s.proc.pid, core_pid(s.proc.pid)

        async def in_flight():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 200}))
                await asyncio.sleep(0.5)
                s.proc.send_signal(signal.SIGTERM)
                try:
                    return (await task).status_code
                except httpx.HTTPError:
                    return None

        asyncio.run(in_flight())
        assert s.proc.wait(60) is not None
        time.sleep(0.5)
        assert not Path(f"/proc/{core}").exists() and children_of(server_pid) == []
    finally:
        s.stop()


def test_chat_template_errors_are_400(test_models_dir, cache_dir):
    """A chat template that refuses the messages (raise_exception) is the client's
    error, in the OpenAI shape (it was Starlette's plain-text 500)."""
    s = Server(test_models_dir / "llama", cache_dir, "--chat-template",
               "{{ raise_exception('this template takes no user turns') }}", api_key=None,
               measure=True)  # the main server's engine: its plan and executables load
    try:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert "this template takes no user turns" in r.json()["error"]["message"]
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        s.stop()


def test_dead_engine_core(test_models_dir, cache_dir):
    # single decode steps, the slower way: its two requests of 1,000 tokens must still run when the core
    # is killed, so it decodes only between the signals below
    # warmed up, so that the signals below stop steps, not a compile at first use (which sends heartbeats)
    s = Server(test_models_dir / "llama", cache_dir, "--max-model-len", "1024", "--engine-hang-timeout", "1.5",
               "--num-scheduler-steps", "1", "--warm-up", api_key=None)
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        core = core_pid(s.proc.pid)
        os.kill(core, signal.SIGSTOP)  # hung while idle: its heartbeats stop
        time.sleep(2.5)
        idle_hung = httpx.get(f"{s.url}/health").status_code
        os.kill(core, signal.SIGCONT)
        time.sleep(1.5)
        assert (idle_hung, httpx.get(f"{s.url}/health").status_code) == (503, 200)

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}
                plain = asyncio.create_task(client.post("/v1/completions", json=body))
                lines = []

                async def streamed():
                    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                        async for line in r.aiter_lines():
                            lines.append(line)

                stream = asyncio.create_task(streamed())
                while metric(s, "vllm:num_requests_running") < 2:
                    await asyncio.sleep(0.01)
                os.kill(core, signal.SIGSTOP)  # hung: busy but silent
                await asyncio.sleep(2.5)
                hung = (await client.get("/health")).status_code
                os.kill(core, signal.SIGCONT)
                deadline = time.monotonic() + 2  # it reports after every step: healthy again at once
                while (recovered := (await client.get("/health")).status_code) != 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                os.kill(core, signal.SIGSTOP)  # its requests still running
                assert (hung, recovered) == (503, 200)
                os.kill(core, signal.SIGKILL)
                deadline = time.monotonic() + 5  # 503 within 5 s, before the server exits
                while (await client.get("/health")).status_code != 503:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await asyncio.wait_for(stream, 30)
                return await asyncio.wait_for(plain, 30), lines

        plain, lines = asyncio.run(run())
        assert plain.status_code == 503 and "engine core" in plain.json()["error"]["message"]
        events = [line for line in lines if line]
        assert any('"error"' in line for line in events) and events[-1] == "data: [DONE]"
        # then the server goes away with status 1, as vLLM's, for a supervisor to restart it
        assert s.proc.wait(30) == 1
        assert "the server exits so that a supervisor can restart it" in s.output()
    finally:
        s.stop()
        assert s.proc.returncode is not None


# ------------------------------------------------------- lm-eval, end to end

LM_EVAL_TASKS = Path(__file__).resolve().parents[2] / "scripts" / "eval_tasks" / "lm_eval"


def lm_eval_run(server, task: str, limit: int) -> list[dict]:
    """lm-eval's local-completions against the server (tokenizer_backend=remote: no
    tokenizer files on the client); its per-sample records."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    os.environ["OPENAI_API_KEY"] = API_KEY
    api = LocalCompletionsAPI(model="tiny", base_url=f"{server.url}/v1/completions", tokenizer_backend="remote",
                              auth_token=API_KEY, batch_size=4, max_length=256, max_retries=1)
    results = lm_eval.simple_evaluate(model=api, tasks=[task], limit=limit, log_samples=True,
                                      task_manager=TaskManager(include_path=str(LM_EVAL_TASKS),
                                                               include_defaults=False))  # lm-eval's own: 13 s to index
    return results["samples"][task]


def test_lm_eval_multiple_choice_scores_equal_offline(server, offline):
    """Every choice's loglikelihood as lm-eval computed it from the server equals
    LLM's offline prompt logprobs of the same tokens, so the chosen answers agree."""
    from jaxllm import SamplingParams

    tokenizer = offline.get_tokenizer()
    samples = lm_eval_run(server, "jaxllm_facts_mc", limit=12)
    assert len(samples) == 12
    pairs = [(tokenizer.encode(context, add_special_tokens=False),
              tokenizer.encode(context + continuation, add_special_tokens=False))
             for s in samples for context, continuation in s["arguments"]]
    outs = offline.generate([whole for _, whole in pairs], SamplingParams(max_tokens=0, prompt_logprobs=0),
                            use_tqdm=False)  # one batch: each prompt's logprobs are its own (batch invariance)
    wants = iter(sum(out.prompt_logprobs[p][whole[p]].logprob for p in range(len(ctx), len(whole)))
                 for (ctx, whole), out in zip(pairs, outs, strict=True))
    for s in samples:
        ours = []
        assert len(s["filtered_resps"]) == len(s["arguments"])  # a score per choice, in the choices' order
        for loglik, _greedy in s["filtered_resps"]:
            want = next(wants)
            assert float(loglik) == pytest.approx(want, abs=1e-4)
            assert want < 0  # a real score: the defect this guards against summed nothing
            ours.append(want)
        scores = [float(r[0]) for r in s["filtered_resps"]]
        assert max(range(4), key=scores.__getitem__) == max(range(4), key=ours.__getitem__)


def test_lm_eval_generation_equals_offline(server, offline):
    from jaxllm import SamplingParams

    samples = lm_eval_run(server, "jaxllm_facts_gen", limit=6)
    tokenizer = offline.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=16, stop=["\n", tokenizer.eos_token])
    outs = offline.generate([tokenizer.encode(s["arguments"][0][0], add_special_tokens=False) for s in samples],
                            params, use_tqdm=False)
    assert [s["resps"][0][0] for s in samples] == [out.outputs[0].text for out in outs]
