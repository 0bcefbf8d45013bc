"""`python -m jaxllm.serve` on 127.0.0.1 in a subprocess, for the tests that drive a
real server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import openai

from tests.support.llm import LAZY

API_KEY = "test-key"
# the engine options every test server starts with (before its extra flags)
OPTIONS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="4MiB")
# the backends of a test server that is not about choosing them: nothing measured at its
# start-up (~10 s of both cores for each new configuration); tests/entrypoints/test_server.py's
# main server starts as a user's does (`auto`, measured) and tests/worker/test_autotune.py covers it
PINNED = dict(attention_backend="cpu", linear_backend="cpu")
# and it compiles each step shape at its first step (tests/support/llm.py's LAZY, as a flag)
LAZY_FLAGS = ("--no-warm-up",)


def flags(options: dict) -> list[str]:
    """Engine options as the server's command-line flags (max_model_len=256: --max-model-len 256)."""
    return [arg for name, value in options.items() for arg in ("--" + name.replace("_", "-"), str(value))]


def offline_options(server: Server, **options) -> dict:
    """LLM options of a test server's engine (OPTIONS, its pinned backends, `options` for
    its extra flags) and its compilation cache: an offline engine of the same model shapes
    loads what the server compiled (and the plan it measured) instead of compiling again."""
    return OPTIONS | server.pinned | dict(compilation_cache_dir=str(server.cache_dir), progress=False) | LAZY | options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path | None, cache_dir: Path, *extra: str, api_key: str | None = API_KEY,
                 measure: bool = False) -> None:
        """`model` None: the embedded default (SmolLM2-135M-Instruct). `measure`: the
        backends `auto` and every step shape compiled at start-up, as a user's server
        starts, rather than PINNED (where `extra` names no backend) and LAZY_FLAGS."""
        self.port, self.cache_dir = free_port(), cache_dir
        self.url = f"http://127.0.0.1:{self.port}"
        self.pinned = {} if measure else {k: v for k, v in PINNED.items() if flags({k: v})[0] not in extra}
        args = [sys.executable, "-m", "jaxllm.serve", *(["--model", str(model)] if model else []), "--port", str(self.port),
                *flags(OPTIONS | self.pinned), *(() if measure else LAZY_FLAGS), "--compilation-cache-dir", str(cache_dir),
                *extra]
        if api_key:
            args += ["--api-key", api_key]
        self.log = open(cache_dir / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ | {"JAXLLM_API_KEY": ""})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            if "jaxllm ready" in self.output():
                return
            time.sleep(0.2)
        raise AssertionError(f"server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


class FakeServer:
    """A benchmark script's launched server, faked: a URL per launch so far, a model
    name, nothing run. `launched`, reset by each test on its subclass, records what the
    subclass's constructor appends."""

    launched: list = []

    def __init__(self, *args, **kwargs) -> None:
        self.url, self.startup_s = f"http://fake/{len(type(self).launched)}", 0.0
        self.proc = types.SimpleNamespace(pid=os.getpid())  # a live process for CpuSeconds to read
        self.engine = ""  # the start-up line a jaxllm server printed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def model(self) -> str:
        return "m"
