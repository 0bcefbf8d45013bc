#!/usr/bin/env python
"""Soak test of the OpenAI-compatible server (issue 17): start `python -m jaxllm.serve`
with a KV pool small enough that requests get preempted, drive it for a fixed time
with a mixed, seeded load from many concurrent clients, check every answer, then
inject faults into the engine core process.

    # 10 minutes, 48 clients, a tiny random-weight test model built on the fly
    python scripts/soak_server.py

    # a short run with a report
    python scripts/soak_server.py --duration 60 --out soak.json

    # a real model (the pool must still be small enough to preempt: see --kv-cache-memory)
    python scripts/soak_server.py --model path/to/model --kv-cache-memory 8MiB

The load (each client a seeded random stream of requests, one at a time): completions
and chat, streaming and not, n 1-3, logprobs, stop strings, short prompts, prompts
sharing long prefixes, prompts near max_model_len, every request with ignore_eos and
a max_tokens that fits; about 10% of the requests leave mid-stream and about 5% are
malformed bodies.

Checks (the script exits 1 when any fails):
- every valid request completes with exactly max_tokens tokens per choice (fewer only
  when a stop string ended it, and then the text holds no stop string), usage agrees,
  streams end with [DONE]; every malformed body gets its 4xx as an OpenAI error; no
  request runs past --request-deadline;
- greedy requests give the same text when sent again alone after the load (batch
  invariance under preemption), and greedy n > 1 choices agree with each other;
- after the load: 0 running, 0 waiting, 0 KV blocks held by requests, no compilation
  after warm-up in the server log, each process's RSS (HTTP server, engine core)
  grows less than 5% from the first to the last minute (a quarter of the run when it
  is shorter than 4 minutes);
- /metrics agrees with what the clients counted: finished requests, prompt and
  generation tokens (a client that left may or may not have let its request finish,
  so those give a range), and preemptions > 0;
- with --pause-every S: every S seconds during the load the server is paused (vLLM's
  /pause, its mode abort, wait or keep and clear_cache drawn at random) and resumed a
  moment later: every /pause and /resume answers 200, a request ends with
  finish_reason abort only when an abort pause fell inside it, nothing else is lost
  or hangs (the checks above);
- faults, after the load on the same server: SIGSTOP of the idle engine core turns
  /health 503 and SIGCONT turns it back to 200; the same with requests in flight,
  which then complete; SIGKILL of the core mid-load ends every open stream with an
  error event, gives the non-streaming requests 5xx, turns /health 503 within 5 s,
  and the server process exits non-zero within 30 s (so a supervisor restarts it).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

API_KEY = "soak-key"
HERE = Path(__file__).resolve().parent
MAX_EXAMPLES = 12  # failing requests kept per check in the report

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "runs", "far", "away", "from", "home", "while", "birds", "sing", "in", "tall", "green", "trees", "near", "a", "quiet", "river", "where", "old", "men", "fish", "every", "morning", "before", "the", "sun", "rises", "above", "hills", "of", "golden", "grass", "children", "play", "with", "red", "balls", "under", "blue", "sky", "people", "talk", "about", "weather", "markets", "news", "stories", "music", "books", "films", "science", "history", "cities", "rivers", "mountains", "oceans", "islands"]
STOPS = ["e", "a", ".", "\n", " the", "zq", "ing", "!"]


# ------------------------------------------------------------------ server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def core_pid(server_pid: int) -> int | None:
    """The engine core: the server's multiprocessing child that is not the resource tracker."""
    for pid in children_of(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    return None


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Server:
    """`python -m jaxllm.serve` in a subprocess, output into a log file."""

    def __init__(self, model: str, log_path: Path, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "jaxllm.serve", "--model", model, "--host", "127.0.0.1",
                    "--port", str(self.port), "--api-key", API_KEY, *args]
        self.proc: subprocess.Popen | None = None
        self.core: int | None = None

    def start(self, timeout: float = 300) -> float:
        print("launching:", " ".join(self.cmd), flush=True)
        start = time.monotonic()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=os.environ | {"JAXLLM_API_KEY": ""})
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail(40)}")
            if "jaxllm ready" in self.log():
                self.core = core_pid(self.proc.pid)
                return time.monotonic() - start
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_tail(40)}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.core is not None and Path(f"/proc/{self.core}").exists():
            try:  # the core we started, if it outlived its server (it should not)
                os.kill(self.core, signal.SIGCONT)
                os.kill(self.core, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def parse_metrics(text: str) -> dict[str, float]:
    """Each series' value, summed over its label sets (finished_reason, engine)."""
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def get_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics", timeout=10)).text)


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> tuple[bool, dict[str, float]]:
    """Until 0 running, 0 waiting and no KV block held (the gauges follow the core's
    stats, which come with each step and a heartbeat every second when idle)."""
    deadline = time.monotonic() + timeout
    m = await get_metrics(client)
    while time.monotonic() < deadline:
        m = await get_metrics(client)
        if (m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0
                and m.get("jaxllm:kv_cache_blocks_used") == 0):
            return True, m
        await asyncio.sleep(0.25)
    return False, m


# ---------------------------------------------------------------- requests

@dataclass
class Spec:
    """One planned request."""

    cid: int
    seq: int
    endpoint: str  # "completions" | "chat"
    body: dict | None = None
    raw: bytes | None = None  # malformed: the bytes sent
    malformed: str | None = None  # what is wrong with it
    expect_status: int | None = None
    stream: bool = False
    n: int = 1
    max_tokens: int = 0
    greedy: bool = False
    logprobs: bool = False
    stop: list[str] | None = None
    prompt_kind: str = ""
    prompt_tokens: int = 0
    leave_after: int | None = None  # chunks, then disconnect

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def describe(self) -> dict:
        body = self.body
        if body is not None:
            body = {k: (_short(v) if k in ("prompt", "messages") else v) for k, v in body.items()}
        return {"client": self.cid, "seq": self.seq, "endpoint": self.endpoint, "stream": self.stream,
                "n": self.n, "max_tokens": self.max_tokens, "greedy": self.greedy, "prompt_kind": self.prompt_kind,
                "prompt_tokens": self.prompt_tokens, "leave_after": self.leave_after, "malformed": self.malformed,
                "body": body if body is not None else (self.raw or b"")[:200].decode("latin-1")}


def _short(value, limit: int = 160) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


@dataclass
class Outcome:
    spec: Spec
    kind: str = ""  # "ok" | "left" | "error" (a clean error) | "hang" | "broken"
    status: int | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    tokens: dict[int, list[str]] | None = None  # per choice, when logprobs were asked
    usage: dict | None = None
    error: dict | None = None
    problems: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    chunks: int = 0
    done_seen: bool = False
    error_events: list[dict] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() when the request was sent
    ended: float = 0.0  # time.monotonic() when the answer ended


class Prompts:
    """Prompt material: short random text, long shared prefixes, near-limit prompts."""

    def __init__(self, rng: random.Random) -> None:
        self.prefixes = [" ".join(rng.choice(WORDS) for _ in range(20)) + "." for _ in range(3)]
        self.long_text = " ".join(rng.choice(WORDS) for _ in range(600))
        self.long_ids: list[int] = []
        self.long_words = {"completions": 0, "chat": 0}  # words of long_text that fit, by endpoint
        self.limit = 0

    async def calibrate(self, client: httpx.AsyncClient, max_model_len: int) -> None:
        self.limit = max_model_len
        self.long_ids = (await tokenize(client, {"prompt": self.long_text}))[1]
        for endpoint in self.long_words:
            lo, hi = 1, len(self.long_text.split())
            while lo < hi:  # the most words whose prompt stays below max_model_len - 12
                mid = (lo + hi + 1) // 2
                count, _ = await tokenize(client, self.tokenize_body(endpoint, self.words(mid)))
                if count <= max_model_len - 12:
                    lo = mid
                else:
                    hi = mid - 1
            self.long_words[endpoint] = lo
        for prefix in self.prefixes:
            count, _ = await tokenize(client, {"prompt": prefix})
            assert count < max_model_len // 2, f"shared prefix too long for max_model_len: {count} tokens"

    def words(self, k: int) -> str:
        return " ".join(self.long_text.split()[:k])

    @staticmethod
    def tokenize_body(endpoint: str, text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text}

    def make(self, rng: random.Random, endpoint: str, kind: str) -> str | list[int]:
        short = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 16)))
        if kind == "shared":
            return rng.choice(self.prefixes) + " " + short
        if kind == "long":
            if endpoint == "completions" and rng.random() < 0.5:
                return self.long_ids[: rng.randint(self.limit - 60, self.limit - 6)]
            k = self.long_words[endpoint]
            return self.words(rng.randint(int(k * 0.8), k))
        return short.capitalize()


async def tokenize(client: httpx.AsyncClient, body: dict) -> tuple[int, list[int]]:
    r = await client.post("/tokenize", json=body, timeout=30)
    r.raise_for_status()
    data = r.json()
    return data["count"], data["tokens"]


MALFORMED = [
    # (endpoint, raw body or dict, what is wrong, expected status)
    ("completions", b"{not json", "invalid JSON", 400),
    ("completions", b'{"prompt": "hi", "max_tokens": 5', "truncated JSON", 400),
    ("chat", b"[1, 2, 3]", "not an object", 400),
    ("completions", b"\xff\xfe\x00garbage", "not UTF-8", 400),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens not an int", 400),
    ("completions", {"prompt": "hi", "temperature": -1}, "negative temperature", 400),
    ("completions", {"prompt": "hi", "n": 0}, "n = 0", 400),
    ("completions", {"prompt": "hi", "frobnicate": True}, "unknown field", 400),
    ("completions", {"max_tokens": 3}, "no prompt", 400),
    ("completions", {"prompt": "hi " * 400, "max_tokens": 4}, "prompt beyond max_model_len", 400),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens beyond the context", 400),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, "unknown model", 404),
    ("completions", {"prompt": [1, 10**7]}, "token id out of range", 400),
    ("chat", {"messages": []}, "no messages", 400),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "bad role", 400),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs without logprobs",
     400),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens 0", 400),
]


def plan_request(rng: random.Random, prompts: Prompts, cid: int, seq: int, *, malformed_frac: float,
                 leave_frac: float, model: str) -> Spec:
    """A random request (its prompt still to be measured, then max_tokens fitted)."""
    if rng.random() < malformed_frac:
        endpoint, body, what, status = rng.choice(MALFORMED)
        spec = Spec(cid, seq, endpoint, malformed=what, expect_status=status)
        if isinstance(body, bytes):
            spec.raw = body
        else:
            spec.body = dict(body)
            spec.body.setdefault("model", model)
        return spec
    endpoint = "chat" if rng.random() < 0.4 else "completions"
    spec = Spec(cid, seq, endpoint)
    spec.stream = rng.random() < 0.5
    spec.n = rng.choices([1, 2, 3], [0.7, 0.2, 0.1])[0]
    spec.greedy = rng.random() < 0.5
    spec.logprobs = rng.random() < 0.3
    spec.stop = [rng.choice(STOPS)] if rng.random() < 0.15 else None
    spec.prompt_kind = rng.choices(["short", "shared", "long"], [0.45, 0.35, 0.2])[0]
    # about leave_frac of all requests leave mid-stream: that share of the streams, doubled
    if spec.stream and rng.random() < 2 * leave_frac:
        spec.leave_after = rng.randint(1, 6)
    spec.max_tokens = rng.randint(16, 64) if spec.leave_after else rng.randint(1, 48)
    prompt = prompts.make(rng, endpoint, spec.prompt_kind)
    body: dict = {"model": model, "max_tokens": spec.max_tokens, "ignore_eos": True, "n": spec.n}
    if spec.greedy:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.5, 1.2), 2)
        body["seed"] = rng.randrange(2**31) if rng.random() < 0.7 else None
        if rng.random() < 0.3:
            body["top_p"] = 0.9
    if spec.stop:
        body["stop"] = spec.stop
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if endpoint == "completions":
        body["prompt"] = prompt
        if spec.logprobs:
            body["logprobs"] = rng.randint(0, 3)
    else:
        content = prompt if isinstance(prompt, str) else prompts.words(40)
        messages = [{"role": "user", "content": content if rng.random() < 0.8 else [{"type": "text", "text": content}]}]
        if spec.prompt_kind != "long" and rng.random() < 0.3:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello."}] + messages
        body["messages"] = messages
        if spec.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
    spec.body = {k: v for k, v in body.items() if v is not None}
    return spec


async def measure(client: httpx.AsyncClient, spec: Spec, max_model_len: int) -> None:
    """The prompt's token count (as the server counts it), and max_tokens cut to fit."""
    body = spec.body
    if spec.endpoint == "chat":
        spec.prompt_tokens, _ = await tokenize(client, {"messages": body["messages"]})
    elif isinstance(body["prompt"], list):
        spec.prompt_tokens = len(body["prompt"])
    else:
        spec.prompt_tokens, _ = await tokenize(client, {"prompt": body["prompt"]})
    room = max_model_len - spec.prompt_tokens
    if room < 1:
        raise RuntimeError(f"prompt of {spec.prompt_tokens} tokens leaves no room (a bug in this script)")
    spec.max_tokens = body["max_tokens"] = min(spec.max_tokens, room)


def clean_error(body) -> str | None:
    """None if `body` is an OpenAI error object, else what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not an OpenAI error body: {_short(body)}"
    err = body["error"]
    if not isinstance(err.get("message"), str) or not err["message"] or "type" not in err or "code" not in err:
        return f"error body lacks message/type/code: {_short(body)}"
    return None


def choice_text(endpoint: str, choice: dict, stream: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


def choice_tokens(endpoint: str, choice: dict) -> list[str] | None:
    lp = choice.get("logprobs")
    if lp is None:
        return None
    if endpoint == "completions":
        return list(lp.get("tokens") or [])
    return [c["token"] for c in lp.get("content") or []]


async def send(client: httpx.AsyncClient, spec: Spec) -> Outcome:
    out = Outcome(spec)
    start = out.started = time.monotonic()
    try:
        if spec.raw is not None or spec.malformed:
            kw = {"content": spec.raw, "headers": {"content-type": "application/json"}} if spec.raw is not None \
                else {"json": spec.body}
            r = await client.post(spec.path, **kw)
            out.status = r.status_code
            out.kind = "error"
            try:
                out.error = r.json()
            except ValueError:
                out.error = {"raw": r.text[:300]}
        elif not spec.stream:
            r = await client.post(spec.path, json=spec.body)
            out.status = r.status_code
            data = r.json()
            if r.status_code != 200:
                out.kind, out.error = "error", data
            else:
                out.kind = "ok"
                out.usage = data.get("usage")
                for choice in data.get("choices", []):
                    i = choice["index"]
                    out.texts[i] = choice_text(spec.endpoint, choice, False)
                    out.finish[i] = choice.get("finish_reason")
                    toks = choice_tokens(spec.endpoint, choice)
                    if toks is not None:
                        out.tokens = out.tokens or {}
                        out.tokens[i] = toks
        else:
            await stream(client, spec, out)
    except httpx.HTTPError as e:
        out.kind = "broken"
        out.problems.append(f"transport error: {type(e).__name__}: {e}")
    except (ValueError, KeyError, TypeError) as e:
        out.kind = "broken"
        out.problems.append(f"unreadable answer: {type(e).__name__}: {e}")
    out.ended = time.monotonic()
    out.elapsed = out.ended - start
    return out


async def stream(client: httpx.AsyncClient, spec: Spec, out: Outcome) -> None:
    async with client.stream("POST", spec.path, json=spec.body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            out.kind = "error"
            try:
                out.error = r.json()
            except ValueError:
                out.error = {"raw": r.text[:300]}
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                out.done_seen = True
                continue
            if out.done_seen:
                out.problems.append("data after [DONE]")
            event = json.loads(payload)
            if "error" in event:
                out.error_events.append(event)
                continue
            if not event.get("choices"):
                if event.get("usage"):
                    out.usage = event["usage"]
                continue
            for choice in event["choices"]:
                i = choice["index"]
                out.texts[i] = out.texts.get(i, "") + choice_text(spec.endpoint, choice, True)
                if choice.get("finish_reason") is not None:
                    if out.finish.get(i) is not None:
                        out.problems.append(f"choice {i}: a second finish_reason")
                    out.finish[i] = choice["finish_reason"]
                else:
                    out.finish.setdefault(i, None)
                toks = choice_tokens(spec.endpoint, choice)
                if toks is not None:
                    out.tokens = out.tokens or {}
                    out.tokens.setdefault(i, []).extend(toks)
            out.chunks += 1
            if spec.leave_after is not None and out.chunks >= spec.leave_after:
                out.kind = "left"
                return  # leaving the `async with` closes the connection mid-stream
    out.kind = "error" if out.error_events else "ok"
    if out.error_events:
        out.error = out.error_events[0]


def validate(out: Outcome, abort_ok: bool = False) -> list[str]:
    """What is wrong with an outcome (kind "hang" is reported by the caller);
    `abort_ok`: a pause with mode abort fell inside it, so its choices may end aborted."""
    spec, problems = out.spec, list(out.problems)
    if out.kind == "broken":
        return problems
    if spec.malformed:
        if out.status != spec.expect_status:
            problems.append(f"malformed body ({spec.malformed}): status {out.status}, expected {spec.expect_status}")
        if (why := clean_error(out.error)) is not None:
            problems.append(why)
        return problems
    if out.kind == "error":
        why = clean_error(out.error)
        problems.append(f"valid request failed: status {out.status}, {_short(out.error, 300)}"
                        + (f" ({why})" if why else ""))
        return problems
    if out.kind == "left":
        return problems
    n, max_tokens = spec.n, spec.max_tokens
    if set(out.texts) != set(range(n)):
        problems.append(f"choice indices {sorted(out.texts)}, expected 0..{n - 1}")
    if spec.stream and not out.done_seen:
        problems.append("stream ended without data: [DONE]")
    for i in range(n):
        reason, text = out.finish.get(i), out.texts.get(i, "")
        stop_hit = [s for s in (spec.stop or []) if s in text]
        if reason not in ("length", "stop", *(("abort",) if abort_ok else ())) or (reason == "stop" and not spec.stop):
            problems.append(f"choice {i}: finish_reason {reason!r}")
        if stop_hit:
            problems.append(f"choice {i}: text holds the stop string {stop_hit[0]!r} ({reason}): {text[:120]!r}")
        if out.tokens is not None:
            got = len(out.tokens.get(i, []))
            if (reason == "length" and got != max_tokens) or got > max_tokens:
                problems.append(f"choice {i}: {got} tokens ({reason}), asked for {max_tokens}")
    usage = out.usage
    if usage is None:
        problems.append("no usage")
    else:
        want_prompt = spec.prompt_tokens
        if usage.get("prompt_tokens") != want_prompt:
            problems.append(f"usage.prompt_tokens {usage.get('prompt_tokens')}, /tokenize counted {want_prompt}")
        got = usage.get("completion_tokens")
        if all(out.finish.get(i) == "length" for i in range(n)):
            if got != n * max_tokens:
                problems.append(f"usage.completion_tokens {got}, expected n x max_tokens = {n * max_tokens}")
        elif got is None or got > n * max_tokens:
            problems.append(f"usage.completion_tokens {got} beyond n x max_tokens = {n * max_tokens}")
        if out.tokens is not None and got != sum(len(t) for t in out.tokens.values()):
            problems.append(f"usage.completion_tokens {got} != {sum(len(t) for t in out.tokens.values())} "
                            "tokens in the logprobs")
    texts = {out.texts.get(i, "") for i in range(n)}
    if any(out.finish.get(i) == "abort" for i in range(n)):  # aborted at different points: each starts the longest
        agree = all(max(texts, key=len).startswith(t) for t in texts)
    else:
        agree = len(texts) == 1
    if spec.greedy and n > 1 and not agree:
        problems.append(f"greedy n={n}: choices differ: {[out.texts.get(i, '')[:60] for i in range(n)]}")
    return problems


# -------------------------------------------------------------------- soak

@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    examples: list = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace, server: Server) -> None:
        self.args = args
        self.server = server
        self.checks: list[Check] = []
        self.info: dict = {}
        self.outcomes: list[Outcome] = []
        self.rss: list[tuple[float, int | None, int | None]] = []
        self.max_model_len = 0
        self.model = ""
        self.pauses: list[dict] = []  # --pause-every: mode, clear_cache, when called and answered, statuses

    def check(self, name: str, ok: bool, detail: str = "", examples: list | None = None) -> bool:
        self.checks.append(Check(name, bool(ok), detail, (examples or [])[:MAX_EXAMPLES]))
        mark = "PASS" if ok else "FAIL"
        print(f"[{mark}] {name}" + (f": {detail}" if detail else ""), flush=True)
        for ex in (examples or [])[:3] if not ok else []:
            print(f"        e.g. {_short(ex, 600)}", flush=True)
        return ok

    def client(self, **kw) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.args.clients + 16, max_keepalive_connections=self.args.clients + 16)
        return httpx.AsyncClient(base_url=self.server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=httpx.Timeout(self.args.request_deadline + 10, connect=10), limits=limits,
                                 **kw)

    # ------------------------------------------------------------- the load

    async def run(self) -> None:
        async with self.client() as client:
            models = (await client.get("/v1/models")).json()["data"][0]
            self.model, self.max_model_len = models["id"], models["max_model_len"]
            prompts = Prompts(random.Random(self.args.seed))
            await prompts.calibrate(client, self.max_model_len)
            await self.warm_up(client)
            _, before = await wait_idle(client, 30)
            self.info["metrics_before"] = before
            load_start = time.monotonic()
            await self.load(client, prompts)
            self.info["load_seconds"] = round(time.monotonic() - load_start, 1)
            idle, after = await wait_idle(client, 30)
            self.info["metrics_after"] = after
            self.check_outcomes()
            self.check_idle(idle, after)
            self.check_metrics(before, after)
            self.check_compilations()
            self.check_rss()
            await self.replay(client)
        await self.faults()

    async def warm_up(self, client: httpx.AsyncClient) -> None:
        """One request of each shape (n=2, logprobs, greedy), before the counting
        starts; its answers are checked too."""
        problems = []
        for endpoint in ("completions", "chat"):
            for stream in (False, True):
                spec = Spec(-1, len(problems), endpoint, stream=stream, n=2, max_tokens=8, greedy=True, logprobs=True,
                            prompt_kind="short")
                body = {"model": self.model, "max_tokens": 8, "ignore_eos": True, "n": 2, "temperature": 0}
                if endpoint == "chat":
                    body |= {"messages": [{"role": "user", "content": "Warm up"}], "logprobs": True, "top_logprobs": 2}
                else:
                    body |= {"prompt": "Warm up", "logprobs": 2}
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                spec.body = body
                await measure(client, spec, self.max_model_len)
                out = await asyncio.wait_for(send(client, spec), self.args.request_deadline)
                problems += [f"{endpoint} stream={stream}: {p}" for p in validate(out)]
        self.check("warm-up requests (each endpoint, streamed and not)", not problems, "; ".join(problems[:3]))

    async def load(self, client: httpx.AsyncClient, prompts: Prompts) -> None:
        end = time.monotonic() + self.args.duration
        t0 = time.monotonic()
        server_pid, core = self.server.proc.pid, self.server.core
        stop_sampling = asyncio.Event()

        async def sample_rss() -> None:
            while not stop_sampling.is_set():
                self.rss.append((time.monotonic() - t0, rss_kib(server_pid), rss_kib(core)))
                try:
                    await asyncio.wait_for(stop_sampling.wait(), self.args.rss_interval)
                except TimeoutError:
                    pass

        async def progress() -> None:
            while not stop_sampling.is_set():
                try:
                    await asyncio.wait_for(stop_sampling.wait(), 15)
                except TimeoutError:
                    m = await get_metrics(client)
                    print(f"  t={time.monotonic() - t0:5.0f} s  requests {len(self.outcomes):5d}  running "
                          f"{m.get('vllm:num_requests_running', 0):.0f}  waiting {m.get('vllm:num_requests_waiting', 0):.0f}"
                          f"  preemptions {m.get('vllm:num_preemptions_total', 0):.0f}", flush=True)

        async def one_client(cid: int) -> None:
            rng = random.Random(self.args.seed * 1_000_003 + cid)
            seq = 0
            while time.monotonic() < end:
                spec = plan_request(rng, prompts, cid, seq, malformed_frac=self.args.malformed_frac,
                                    leave_frac=self.args.leave_frac, model=self.model)
                seq += 1
                start = time.monotonic()
                try:
                    out = await asyncio.wait_for(self.one(client, spec), self.args.request_deadline)
                except TimeoutError:
                    out = Outcome(spec, kind="hang", elapsed=time.monotonic() - start)
                except (httpx.HTTPError, RuntimeError) as e:
                    out = Outcome(spec, kind="broken", elapsed=time.monotonic() - start,
                                  problems=[f"preparing the request: {type(e).__name__}: {e}"])
                self.outcomes.append(out)

        samplers = [asyncio.create_task(sample_rss()), asyncio.create_task(progress())]
        if self.args.pause_every > 0:
            samplers.append(asyncio.create_task(self.pauser(client, stop_sampling)))
        try:
            await asyncio.gather(*[one_client(c) for c in range(self.args.clients)])
        finally:
            stop_sampling.set()
            await asyncio.gather(*samplers)

    async def pauser(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """--pause-every: pause the server (a random mode and clear_cache) every so
        often, resume it a moment later; each call recorded."""
        rng = random.Random(self.args.seed + 29)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.args.pause_every)
                return
            except TimeoutError:
                pass
            mode, clear = rng.choice(["abort", "wait", "keep"]), rng.choice(["true", "false"])
            called = time.monotonic()
            paused = await client.post("/pause", params={"mode": mode, "clear_cache": clear})
            answered = time.monotonic()
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            resumed = await client.post("/resume")
            self.pauses.append({"mode": mode, "clear_cache": clear, "called": called, "answered": answered,
                                "status": [paused.status_code, resumed.status_code]})

    def abort_ok(self, out: Outcome) -> bool:
        """Whether an abort pause fell inside `out`'s request."""
        return any(p["mode"] == "abort" and out.started <= p["answered"] and p["called"] <= out.ended
                   for p in self.pauses)

    async def one(self, client: httpx.AsyncClient, spec: Spec) -> Outcome:
        if not spec.malformed:
            await measure(client, spec, self.max_model_len)
        return await send(client, spec)

    # --------------------------------------------------------------- checks

    def check_outcomes(self) -> None:
        outs = self.outcomes
        kinds: dict[str, int] = {}
        for o in outs:
            key = "malformed" if o.spec.malformed else o.kind
            kinds[key] = kinds.get(key, 0) + 1
        valid = [o for o in outs if not o.spec.malformed]
        self.info["requests"] = {
            "total": len(outs), "outcomes": kinds,
            "completions": sum(o.spec.endpoint == "completions" for o in valid),
            "chat": sum(o.spec.endpoint == "chat" for o in valid),
            "streaming": sum(o.spec.stream for o in valid),
            "n>1": sum(o.spec.n > 1 for o in valid),
            "greedy": sum(o.spec.greedy for o in valid),
            "logprobs": sum(o.spec.logprobs for o in valid),
            "stop strings": sum(bool(o.spec.stop) for o in valid),
            "stopped by a stop string": sum(any(f == "stop" for f in o.finish.values()) for o in valid),
            "prompt kinds": {k: sum(o.spec.prompt_kind == k for o in valid) for k in ("short", "shared", "long")},
            "left mid-stream": kinds.get("left", 0),
            "malformed": sum(bool(o.spec.malformed) for o in outs),
            "generated tokens (client count)": sum((o.usage or {}).get("completion_tokens", 0)
                                                   for o in valid if o.kind == "ok"),
        }
        latencies = sorted(o.elapsed for o in outs if o.kind in ("ok", "error"))
        if latencies:
            self.info["latency_s"] = {"p50": round(latencies[len(latencies) // 2], 2),
                                      "p99": round(latencies[int(len(latencies) * 0.99)], 2),
                                      "max": round(latencies[-1], 2)}
        hangs = [o for o in outs if o.kind == "hang"]
        self.check(f"no request past the {self.args.request_deadline:.0f} s deadline", not hangs,
                   f"{len(hangs)} hung" if hangs else f"slowest {latencies[-1] if latencies else 0:.1f} s",
                   [o.spec.describe() for o in hangs])
        bad = [(o, p) for o in outs if o.kind != "hang" for p in validate(o, self.abort_ok(o))]
        kinds_of_problems: dict[str, int] = {}
        for o, p in bad:
            what = "malformed" if o.spec.malformed else f"{o.spec.endpoint} {'stream' if o.spec.stream else 'plain'}"
            what += f" logprobs={o.spec.logprobs}: " + re.sub(r"\d+", "N", re.sub(r"'.*'|\[.*\]", "...", p))[:90]
            kinds_of_problems[what] = kinds_of_problems.get(what, 0) + 1
        self.info["problem_kinds"] = dict(sorted(kinds_of_problems.items(), key=lambda kv: -kv[1]))
        affected = len({id(o) for o, _ in bad})
        self.check("every request completes with exactly the tokens asked for, or gets a clean OpenAI error",
                   not bad and len(outs) > 0,
                   f"{len(outs)} requests, {affected} with problems"
                   + (f"; by kind: {self.info['problem_kinds']}" if bad else ""),
                   [{"problem": p, "request": o.spec.describe(), "status": o.status,
                     "texts": {i: t[:100] for i, t in o.texts.items()}} for o, p in bad])
        left = kinds.get("left", 0) / max(len(outs), 1)
        mal = kinds.get("malformed", 0) / max(len(outs), 1)
        self.check("the mix has streams that leave and malformed bodies", left > 0 and mal > 0,
                   f"{left:.1%} left mid-stream, {mal:.1%} malformed")
        if self.args.pause_every > 0:
            self.check_pauses(outs)

    def check_pauses(self, outs: list[Outcome]) -> None:
        failed = [p for p in self.pauses if p["status"] != [200, 200]]
        modes = {m: sum(p["mode"] == m for p in self.pauses) for m in ("abort", "wait", "keep")}
        aborted = sum(any(f == "abort" for f in o.finish.values()) for o in outs)
        self.info["pauses"] = {"by mode": modes, "requests aborted by them": aborted,
                               "slowest pause answer_s": round(max((p["answered"] - p["called"] for p in self.pauses),
                                                                   default=0), 2)}
        self.check("every /pause and /resume answered 200 under the load", self.pauses and not failed,
                   f"{len(self.pauses)} pauses {modes}; {aborted} requests aborted by them", failed)

    def check_idle(self, idle: bool, m: dict[str, float]) -> None:
        detail = (f"running {m.get('vllm:num_requests_running')}, waiting {m.get('vllm:num_requests_waiting')}, "
                  f"KV blocks held {m.get('jaxllm:kv_cache_blocks_used')}, usage {m.get('vllm:kv_cache_usage_perc')}")
        self.check("after the load: 0 running, 0 waiting, 0 KV blocks in use", idle, detail)

    def check_metrics(self, before: dict[str, float], after: dict[str, float]) -> None:
        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        done = [o for o in self.outcomes if not o.spec.malformed and o.kind == "ok"]
        left = [o for o in self.outcomes if o.kind == "left"]
        hung = [o for o in self.outcomes if o.kind in ("hang", "broken") and not o.spec.malformed]
        uncertain = left + hung  # may or may not have finished in the engine
        rows = [
            ("vllm:request_success_total", sum(o.spec.n for o in done), sum(o.spec.n for o in uncertain)),
            ("vllm:prompt_tokens_total", sum(o.usage["prompt_tokens"] for o in done),
             sum(o.spec.prompt_tokens for o in uncertain)),
            ("vllm:generation_tokens_total", sum(o.usage["completion_tokens"] for o in done),
             sum(o.spec.n * o.spec.max_tokens for o in uncertain)),
        ]
        bad, parts = [], []
        for name, exact, slack in rows:
            got = delta(name)
            parts.append(f"{name.split(':')[1]} {got:.0f} (clients: {exact}" + (f"..{exact + slack}" if slack else "")
                         + ")")
            if not exact <= got <= exact + slack:
                bad.append({"metric": name, "server": got, "client_min": exact, "client_max": exact + slack})
        self.info["metrics_vs_clients"] = parts
        self.check("/metrics counters agree with the clients' counts", not bad, "; ".join(parts), bad)
        preemptions = delta("vllm:num_preemptions_total")
        self.info["preemptions"] = preemptions
        self.check("preemptions happened under the load", preemptions > 0, f"{preemptions:.0f} preemptions")

    def check_compilations(self) -> None:
        lines = [ln for ln in self.server.log().splitlines() if "after warm-up" in ln]
        self.check("0 compilations after warm-up (server log)", not lines, f"{len(lines)} found", lines)

    def check_rss(self) -> None:
        samples = [s for s in self.rss if s[1] is not None and s[2] is not None]
        if len(samples) < 4:
            self.check("server RSS growth below 5%", False, f"only {len(samples)} RSS samples")
            return
        total = samples[-1][0]
        window = 60.0 if total >= 240 else total / 4
        first = [s for s in samples if s[0] <= window]
        last = [s for s in samples if s[0] >= total - window]
        parts, ok, rss = [], True, {}
        for idx, name in ((1, "server"), (2, "engine core")):
            a = statistics.median(s[idx] for s in first)
            b = statistics.median(s[idx] for s in last)
            growth = b / a - 1
            ok &= growth < self.args.max_rss_growth
            rss[name] = {"first_MiB": round(a / 1024, 1), "last_MiB": round(b / 1024, 1), "growth": round(growth, 4)}
            parts.append(f"{name} {a / 1024:.0f} -> {b / 1024:.0f} MiB ({growth:+.1%})")
        self.info["rss"] = rss | {"window_s": round(window, 1), "samples": len(samples)}
        self.check(f"RSS growth below {self.args.max_rss_growth:.0%} (median of the first vs the last "
                   f"{window:.0f} s)", ok, "; ".join(parts))

    # ------------------------------------------------------ batch invariance

    async def replay(self, client: httpx.AsyncClient) -> None:
        greedy = [o for o in self.outcomes if o.kind == "ok" and o.spec.greedy and not validate(o)]  # (none aborted)
        rng = random.Random(self.args.seed + 17)
        long_first = [o for o in greedy if o.spec.prompt_kind == "long"]
        rest = [o for o in greedy if o.spec.prompt_kind != "long"]
        rng.shuffle(long_first)
        rng.shuffle(rest)
        half = self.args.replay // 2
        picked = long_first[:half] + rest[: self.args.replay - min(half, len(long_first))]
        picked = picked[: self.args.replay]
        diffs, start = [], time.monotonic()
        for o in picked:
            body = {k: v for k, v in o.spec.body.items() if k not in ("stream", "stream_options")}
            r = await client.post(o.spec.path, json=body, timeout=self.args.request_deadline)
            if r.status_code != 200:
                diffs.append({"request": o.spec.describe(), "alone": f"status {r.status_code}: {r.text[:200]}"})
                continue
            for choice in r.json()["choices"]:
                i = choice["index"]
                alone, loaded = choice_text(o.spec.endpoint, choice, False), o.texts.get(i, "")
                toks = choice_tokens(o.spec.endpoint, choice)
                same_tokens = toks is None or o.tokens is None or toks == o.tokens.get(i)
                if alone != loaded or not same_tokens or choice.get("finish_reason") != o.finish.get(i):
                    at = next((k for k, (a, b) in enumerate(zip(alone, loaded)) if a != b), min(len(alone), len(loaded)))
                    diffs.append({"request": o.spec.describe(), "choice": i, "first_difference_at_char": at,
                                  "under_load": loaded[max(0, at - 20): at + 60],
                                  "alone": alone[max(0, at - 20): at + 60],
                                  "finish": [o.finish.get(i), choice.get("finish_reason")]})
                    break
        self.info["replayed"] = len(picked)
        self.check("greedy requests give the same tokens alone as under load (batch invariance under preemption)",
                   bool(picked) and not diffs,
                   f"{len(picked)} of {len(greedy)} greedy requests sent again alone in "
                   f"{time.monotonic() - start:.0f} s; {len(diffs)} differ", diffs)

    # ---------------------------------------------------------------- faults

    async def faults(self) -> None:
        core = self.server.core
        if core is None or not Path(f"/proc/{core}").exists():
            self.check("engine core process found", False, "no engine core process")
            return
        hang = self.args.engine_hang_timeout
        async with self.client() as client:
            await wait_idle(client, 30)
            # SIGSTOP, idle: the core's heartbeats stop
            healthy = (await client.get("/health")).status_code
            t503, t200 = await self.stop_and_continue(client, core, hang)
            self.check("SIGSTOP of the idle engine core turns /health 503, SIGCONT back to 200",
                       healthy == 200 and t503 is not None and t200 is not None,
                       f"before {healthy}; 503 after {_secs(t503)} (hang timeout {hang} s); "
                       f"200 {_secs(t200)} after SIGCONT")
            await self.stop_busy(client, core, hang)
            await self.kill_mid_load(client, core)

    async def stop_and_continue(self, client: httpx.AsyncClient, core: int,
                                hang: float) -> tuple[float | None, float | None]:
        """SIGSTOP the core until /health says 503, then SIGCONT: (seconds to the 503,
        seconds from SIGCONT to the 200), None where it did not come."""
        os.kill(core, signal.SIGSTOP)
        try:
            t503 = await self.wait_health(client, 503, hang + 10)
        finally:
            os.kill(core, signal.SIGCONT)
        return t503, await self.wait_health(client, 200, 10)

    async def wait_health(self, client: httpx.AsyncClient, status: int, timeout: float) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                if (await client.get("/health", timeout=2)).status_code == status:
                    return time.monotonic() - start
            except httpx.HTTPError:
                if status != 200:
                    return time.monotonic() - start  # the server is gone: not healthy either
            await asyncio.sleep(0.1)
        return None

    async def stop_busy(self, client: httpx.AsyncClient, core: int, hang: float) -> None:
        """SIGSTOP with requests in flight: 503 while stopped, then they finish."""
        await wait_idle(client, 30)
        specs = []
        for i in range(2):
            spec = Spec(-2, i, "completions", stream=bool(i), max_tokens=120, prompt_kind="short")
            spec.body = {"model": self.model, "prompt": f"Busy {i}", "max_tokens": 120, "ignore_eos": True,
                         "temperature": 0} | ({"stream": True, "stream_options": {"include_usage": True}} if i else {})
            spec.prompt_tokens, _ = await tokenize(client, {"prompt": f"Busy {i}"})
            specs.append(spec)
        tasks = [asyncio.create_task(send(client, s)) for s in specs]
        await self.wait_running(client, 2, 20)
        t503, t200 = await self.stop_and_continue(client, core, hang)
        done, _ = await asyncio.wait(tasks, timeout=60)
        outs = [t.result() for t in done]
        for t in tasks:
            t.cancel()
        problems = [p for o in outs for p in validate(o)] + ([f"{len(tasks) - len(done)} requests hung"]
                                                               if len(done) < len(tasks) else [])
        self.check("SIGSTOP of the busy engine core turns /health 503; after SIGCONT it is 200 and the "
                   "requests in flight complete", t503 is not None and t200 is not None and not problems,
                   f"503 after {_secs(t503)}; 200 {_secs(t200)} after SIGCONT; "
                   + (f"problems: {problems[:3]}" if problems else "both requests complete"))

    async def wait_running(self, client: httpx.AsyncClient, n: int, timeout: float) -> bool:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if (await get_metrics(client)).get("vllm:num_requests_running", 0) >= n:
                return True
            await asyncio.sleep(0.05)
        return False

    async def kill_mid_load(self, client: httpx.AsyncClient, core: int) -> None:
        """SIGKILL of the core with streams and non-streaming requests in flight: each
        request either finished before the kill (complete and valid) or ends with an
        error (an error event in its stream, or a 5xx)."""
        await wait_idle(client, 30)
        specs = []
        for i in range(3 * self.args.max_num_seqs):
            endpoint = "chat" if i % 4 == 3 else "completions"
            spec = Spec(-3, i, endpoint, stream=i % 2 == 0, max_tokens=self.max_model_len, prompt_kind="short")
            body = {"model": self.model, "max_tokens": self.max_model_len, "ignore_eos": True, "temperature": 0.7,
                    "seed": i}
            body |= ({"messages": [{"role": "user", "content": f"Doomed {i}"}]} if endpoint == "chat"
                     else {"prompt": f"Doomed {i}"})
            if spec.stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            spec.body = body
            await measure(client, spec, self.max_model_len)  # max_tokens: up to the context
            specs.append(spec)
        tasks = [asyncio.create_task(send(client, s)) for s in specs]
        await self.wait_running(client, self.args.max_num_seqs, 30)
        kill_time = time.monotonic()
        os.kill(core, signal.SIGKILL)
        t503 = await self.wait_health(client, 503, 5)
        self.check("SIGKILL of the engine core: /health 503 within 5 s", t503 is not None, f"after {_secs(t503)}")
        done, _ = await asyncio.wait(tasks, timeout=30)
        for t in tasks:
            t.cancel()
        problems, finished, cut, done_after_error = [], 0, {"stream": 0, "plain": 0}, 0
        for spec, task in zip(specs, tasks):
            if task not in done:
                problems.append({"request": spec.describe(), "problem": "still open 30 s after the kill"})
                continue
            o = task.result()
            if o.kind == "ok" and not validate(o):
                finished += 1  # it was not open: it finished before the kill
                continue
            if spec.stream and o.status == 200:
                if not o.error_events:
                    problems.append({"request": spec.describe(), "ended_after_kill_s": round(o.ended - kill_time, 2),
                                     "problem": f"stream ended without an error event ({o.kind}, chunks {o.chunks}, "
                                                f"finish {o.finish}, usage {o.usage}, problems {o.problems})"})
                elif (why := clean_error(o.error_events[0])) is not None:
                    problems.append({"request": spec.describe(), "problem": why})
                else:
                    cut["stream"] += 1
                    done_after_error += o.done_seen
            elif o.status is not None and o.status >= 500 and clean_error(o.error) is None:
                cut["stream" if spec.stream else "plain"] += 1
            else:
                problems.append({"request": spec.describe(), "ended_after_kill_s": round(o.ended - kill_time, 2),
                                 "problem": f"status {o.status}, {o.kind}: {_short(o.error)} {o.problems}"})
        self.info["core_kill"] = {"finished_before": finished, "cut": cut, "streams_with_done_after_error":
                                  done_after_error, "problems": len(problems)}
        self.check("SIGKILL of the engine core: every open stream ends with an error event, non-streaming "
                   "requests get 5xx", not problems and cut["stream"] > 0 and cut["plain"] > 0,
                   f"{len(specs)} requests: {finished} finished before the kill, {cut['stream']} streams ended with "
                   f"an error event ({done_after_error} then [DONE]), {cut['plain']} got 5xx; {len(problems)} problems",
                   problems)
        try:
            after = await client.post("/v1/completions", json={"model": self.model, "prompt": "Hi", "max_tokens": 2},
                                      timeout=10)
            late = f"a new request gets {after.status_code}"
            late_ok = after.status_code == 503 and clean_error(after.json()) is None
        except httpx.HTTPError as e:
            late, late_ok = f"a new request: {type(e).__name__} (server gone)", True
        self.check("SIGKILL of the engine core: new requests get 503 (or no server)", late_ok, late)
        proc = self.server.proc
        remaining = 30 - (time.monotonic() - kill_time)
        try:
            code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            code = None
        waited = time.monotonic() - kill_time
        self.info["exit_after_core_kill"] = {"exit_code": code, "seconds": round(waited, 1)}
        self.check("SIGKILL of the engine core: the server process exits non-zero within 30 s",
                   code is not None and code != 0,
                   f"exit code {code} after {waited:.1f} s" if code is not None
                   else f"still running {waited:.0f} s after the kill")


def _secs(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f} s"


# -------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model for the server (default: a tiny random test model, built "
                                                 "into a temporary folder by scripts/make_test_model.py)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="1MiB",
                   help="small enough to preempt (the tiny model: 1MiB = 63 blocks of 16 tokens)")
    p.add_argument("--engine-hang-timeout", type=float, default=5.0,
                   help="the server's; the SIGSTOP checks wait this long plus 10 s for /health 503")
    p.add_argument("--compilation-cache-dir", default=None, help="the server's (default: its own default)")
    p.add_argument("--server-args", default="", help="more flags for the server")
    p.add_argument("--request-deadline", type=float, default=120.0, help="seconds before a request counts as hung")
    p.add_argument("--replay", type=int, default=64, help="greedy requests to send again alone")
    p.add_argument("--malformed-frac", type=float, default=0.05)
    p.add_argument("--leave-frac", type=float, default=0.10)
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--rss-interval", type=float, default=1.0)
    p.add_argument("--pause-every", type=float, default=0.0,
                   help="seconds between pauses of the server during the load (its development endpoints: /pause with "
                        "a random mode, then /resume); 0: none")
    p.add_argument("--log", default=None, help="the server's log file (default: in a temporary folder, kept on failure)")
    return p.parse_args(argv)


def build_test_model(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_test_model", HERE / "make_test_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_model(out, "llama")


def server_args(args: argparse.Namespace) -> list[str]:
    import shlex

    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory", args.kv_cache_memory,
             "--engine-hang-timeout", str(args.engine_hang_timeout), "--max-waiting-requests", "512"]
    if args.compilation_cache_dir:
        flags += ["--compilation-cache-dir", args.compilation_cache_dir]
    if args.pause_every > 0:
        flags += ["--server-dev-mode"]
    return flags + shlex.split(args.server_args)


def print_summary(report: dict) -> None:
    print("\n==================== soak summary ====================")
    info = report["info"]
    print(f"duration {report['args']['duration']:.0f} s, {report['args']['clients']} clients, seed "
          f"{report['args']['seed']}; server ready in {info.get('startup_s', 0):.1f} s; total {report['seconds']:.0f} s")
    req = info.get("requests")
    if req:
        print(f"requests: {req['total']} ({req['completions']} completions, {req['chat']} chat, {req['streaming']} "
              f"streamed, {req['n>1']} with n>1, {req['greedy']} greedy, {req['logprobs']} logprobs, "
              f"{req['stop strings']} with stop strings ({req['stopped by a stop string']} stopped), prompts "
              f"{req['prompt kinds']}); left mid-stream {req['left mid-stream']}, malformed {req['malformed']}")
        print(f"outcomes: {req['outcomes']}; generated tokens {req['generated tokens (client count)']}; "
              f"latency {info.get('latency_s')}")
    if "preemptions" in info:
        print(f"preemptions: {info['preemptions']:.0f}; metrics vs clients: {'; '.join(info['metrics_vs_clients'])}")
    if "rss" in info:
        print(f"RSS: {info['rss']}")
    for c in report["checks"]:
        print(f"  [{'PASS' if c['ok'] else 'FAIL'}] {c['name']}" + (f": {c['detail']}" if c["detail"] else ""))
    failed = [c for c in report["checks"] if not c["ok"]]
    print(f"{len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed"
          + ("" if not failed else f"; FAILED: {', '.join(c['name'] for c in failed)}"))
    if report.get("error"):
        print(f"ERROR: {report['error']}")
    if failed or report.get("error"):
        print(f"server log: {report['server_log']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jaxllm-soak-") as tmp:
        model = args.model or str(build_test_model(Path(tmp)))
        log_path = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="jaxllm-soak-log-")) / "server.log"
        server = Server(model, log_path, server_args(args))
        soak = Soak(args, server)
        error = None
        try:
            soak.info["startup_s"] = round(server.start(), 1)
            asyncio.run(soak.run())
        except Exception as e:
            import traceback

            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            server.stop()
        report = {"args": vars(args), "seconds": round(time.monotonic() - t0, 1), "server_log": str(log_path),
                  "server_cmd": server.cmd, "info": soak.info, "checks": [asdict(c) for c in soak.checks],
                  "error": error}
        report["passed"] = error is None and bool(soak.checks) and all(c.ok for c in soak.checks)
        if not report["passed"]:
            interesting = [ln for ln in server.log().splitlines()
                           if re.search(r"ERROR|Traceback|Error|WARNING|after warm-up", ln)]
            report["server_log_excerpt"] = interesting[-40:]
        print_summary(report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str))
        if report["passed"] and not args.log:
            import shutil

            shutil.rmtree(log_path.parent, ignore_errors=True)
        return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
