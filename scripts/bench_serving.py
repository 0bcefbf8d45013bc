#!/usr/bin/env python
"""Serving benchmark, like `vllm bench serve`: drive an OpenAI-compatible server
(`python -m jaxllm.serve`, or any other) over HTTP and report latency and throughput.

    # against a running server, 32 concurrent clients, the standard workload
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --dataset standard --max-concurrency 32

    # launch jaxllm itself, sweep concurrency, write JSON and plots
    python scripts/bench_serving.py --launch "--max-num-seqs 64" --dataset standard --concurrency-sweep 1,8,32,64

    # the same against llama.cpp's llama-server first (same workload, same run)
    python scripts/bench_serving.py --launch "" --max-concurrency 32 \
        --llama-server path/to/llama-server --llama-gguf smollm2-f32.gguf

    # two jaxllm configurations on the same requests, one launched server after the other
    # (and llama-server first): the Q8_0 file kept against the same file dequantized
    python scripts/bench_serving.py --launch "--model build/smollm2-q8_0.gguf" --max-concurrency 32 \
        --compare-launch "--model build/smollm2-q8_0.gguf --quantization none" \
        --llama-server path/to/llama-server --llama-gguf build/smollm2-q8_0.gguf

    # shared-prefix dataset with and without prefix caching (two launched servers)
    python scripts/bench_serving.py --compare-prefix-caching --max-concurrency 16

    # as on an AVX2-only CPU: the launched servers' kernels and XLA (scripts/isa_build.py;
    # pair it with an AVX2 build of llama-server: LLAMA_ISA=avx2 scripts/build_llama_server.sh)
    python scripts/bench_serving.py --isa avx2 --launch "" --max-concurrency 32

Per request: TTFT (time to first token), TPOT (time per output token after the first),
ITL (gaps between streamed chunks), end-to-end latency; mean, p50, p90, p99 of each;
request and token throughput. Prompts are token ids (the completions endpoint takes
them), outputs have exact lengths (ignore_eos + max_tokens). While it runs it samples
the server's /metrics for the KV accounting: peak blocks in use, tokens held, waste.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from isa_build import ISAS, describe, reexec

# ----------------------------------------------------------------- datasets


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


def standard_dataset(n: int = 200, seed: int = 0, vocab: int = 49152) -> list[BenchRequest]:
    """The project's standard workload: prompts U[32, 512], outputs U[16, 256]."""
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(100, vocab, int(rng.integers(32, 513))).tolist(), int(rng.integers(16, 257)))
            for _ in range(n)]


def random_dataset(n: int, input_len: int, output_len: int, seed: int = 0, vocab: int = 49152) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(100, vocab, input_len).tolist(), output_len) for _ in range(n)]


def shared_prefix_dataset(n: int = 64, prefix_len: int = 1024, suffix_len: int = 64, output_len: int = 128,
                          seed: int = 0, vocab: int = 49152) -> list[BenchRequest]:
    """n requests sharing one system prompt, each with a unique suffix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, vocab, prefix_len).tolist()
    return [BenchRequest(prefix + rng.integers(100, vocab, suffix_len).tolist(), output_len) for _ in range(n)]


# ------------------------------------------------------------------- client


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def run_one(client: httpx.AsyncClient, model: str, req: BenchRequest) -> RequestResult:
    """One streamed request. A pooled keep-alive connection the server already closed
    fails at once with RemoteProtocolError before any response (llama-server drops idle
    connections after 5 s); that request never reached the server and is sent again."""
    for _ in range(2):
        result = await _run_once(client, model, req)
        if not result.error.startswith("RemoteProtocolError") or result.ttft:
            return result
    return await _run_once(client, model, req)


async def _run_once(client: httpx.AsyncClient, model: str, req: BenchRequest) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return RequestResult(ok=False, error=str(data["error"]))
                now = time.perf_counter()
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("text") is not None:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens == req.output_len
        if not result.ok:
            result.error = f"got {result.output_tokens} tokens, wanted {req.output_len}"
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


# Once a second: at ten a second, the servers' renderings of /metrics (and the client's
# parsing of them) took a part of the two cores a run is measured on, vLLM's more than
# jaxllm's (docs/bench-log/2026-12-03-zen3-avx2.md): the polling, not only the serving,
# was measured.
KV_POLL_SECONDS = 1.0


async def sample_kv(client: httpx.AsyncClient, stop: asyncio.Event, samples: list[dict]) -> None:
    """Poll /metrics for KV accounting while the benchmark runs (every KV_POLL_SECONDS)."""
    pattern = re.compile(r"^((?:jaxllm|vllm):[a-z_]+)\{[^}]*\} (\S+)$", re.M)
    while not stop.is_set():
        try:
            text = (await client.get("/metrics")).text
            values = {k: float(v) for k, v in pattern.findall(text)}
            if "jaxllm:kv_cache_blocks_used" in values:
                samples.append(values)
        except httpx.HTTPError:
            pass
        try:  # woken by the end of the run, not a second after it
            await asyncio.wait_for(stop.wait(), KV_POLL_SECONDS)
        except TimeoutError:
            pass


async def benchmark(base_url: str, model: str | list[str], requests: list[BenchRequest], *,
                    max_concurrency: int | None, request_rate: float, seed: int = 0) -> dict:
    """`model` a list: request i asks for model i mod its length (LoRA adapters, spread)."""
    models = [model] if isinstance(model, str) else model
    limits = httpx.Limits(max_connections=(max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600.0), limits=limits,
                                 headers=_auth_headers()) as client:
        semaphore = asyncio.Semaphore(max_concurrency or len(requests))
        rng = np.random.default_rng(seed)
        stop, kv_samples = asyncio.Event(), []
        sampler = asyncio.create_task(sample_kv(client, stop, kv_samples))

        async def limited(req: BenchRequest, model: str) -> RequestResult:
            async with semaphore:
                return await run_one(client, model, req)

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(limited(req, models[i % len(models)])))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        await sampler
    return summarize(results, duration, kv_samples) | {"max_concurrency": max_concurrency, "request_rate": request_rate}


def _auth_headers() -> dict[str, str]:
    key = os.environ.get("JAXLLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1000.0  # ms
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float, kv_samples: list[dict]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
        "ttft_values_s": [r.ttft for r in ok], "e2e_values_s": [r.e2e for r in ok],
    }
    if kv_samples:
        peak = max(kv_samples, key=lambda s: s["jaxllm:kv_cache_blocks_used"])
        blocks, held = peak["jaxllm:kv_cache_blocks_used"], peak["jaxllm:kv_cache_tokens_held"]
        block_size = peak.get("jaxllm:kv_cache_block_size", 16)
        summary["kv"] = {"peak_blocks_in_use": blocks, "tokens_held_at_peak": held,
                         "waste_at_peak": 1 - held / (blocks * block_size) if blocks else 0.0}
        hits = max(s.get("vllm:prefix_cache_hits_total", 0) for s in kv_samples)
        queries = max(s.get("vllm:prefix_cache_queries_total", 0) for s in kv_samples)
        summary["prefix_cache_hit_rate_cumulative"] = hits / queries if queries else 0.0
    return summary


def print_summary(title: str, s: dict) -> None:
    print(f"\n== {title} ==")
    print(f"completed {s['completed']}/{s['num_requests']} in {s['duration_s']:.1f} s"
          + (f"  (errors: {s['errors']})" if s["failed"] else ""))
    print(f"request throughput {s['request_throughput']:.2f} req/s | output {s['output_token_throughput']:.1f} tok/s | "
          f"total {s['total_token_throughput']:.1f} tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        if v["mean"] is not None:
            print(f"{key[:-3].upper():>5} ms: mean {v['mean']:8.1f}  p50 {v['p50']:8.1f}  p90 {v['p90']:8.1f}  p99 {v['p99']:8.1f}")
    if "cpu_s" in s:
        print(format_cpu_seconds(s["cpu_s"]))
    if "kv" in s:
        kv = s["kv"]
        print(f"KV at peak: {kv['peak_blocks_in_use']:.0f} blocks in use, {kv['tokens_held_at_peak']:.0f} tokens held, "
              f"waste {100 * kv['waste_at_peak']:.2f}%; prefix-cache hit rate {100 * s['prefix_cache_hit_rate_cumulative']:.1f}%")


# ------------------------------------------------------------- CPU seconds


def _process_cpu_seconds() -> dict[int, tuple[int, str, float]]:
    """Every process's (parent pid, name, user + system CPU seconds so far), from /proc
    (empty where there is none)."""
    ticks, found = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone since the listing
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        found[int(entry)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])) / ticks)
    return found


def process_tree_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of process `pid` ("server") and of each of its descendants
    ("<name> <pid>": vLLM's engine core names itself, jaxllm's is a python child)."""
    procs = _process_cpu_seconds()
    tree, grew = {pid}, True
    while grew:
        more = {p for p, (ppid, _, _) in procs.items() if ppid in tree} - tree
        tree, grew = tree | more, bool(more)
    return {("server" if p == pid else f"{procs[p][1]} {p}"): procs[p][2] for p in sorted(tree) if p in procs}


class CpuSeconds:
    """The CPU seconds a server's processes (`pid` and its descendants) and this client
    spent inside the `with` block: on a 2-core host they share the cores with the engine,
    so a server's frontend is part of what its throughput costs. Also the seconds the
    hypervisor took from this machine's cores meanwhile ("stolen": a shared host can run
    other guests on them; stolen_share)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.result = pid, {}

    def __enter__(self) -> CpuSeconds:
        self.server0, self.client0, self.wall0 = process_tree_cpu_seconds(self.pid), _own_cpu_seconds(), time.perf_counter()
        self.stolen0 = _stolen_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        server1, stolen1 = process_tree_cpu_seconds(self.pid), _stolen_cpu_seconds()
        self.result = {"server": {k: v - self.server0.get(k, 0.0) for k, v in server1.items()},
                       "client": _own_cpu_seconds() - self.client0, "wall": time.perf_counter() - self.wall0}
        if self.stolen0 is not None and stolen1 is not None:
            self.result |= {"stolen": stolen1 - self.stolen0, "cores": os.cpu_count() or 1}


def _stolen_cpu_seconds() -> float | None:
    from jaxllm.platform import stolen_cpu_seconds  # here: --isa re-runs the script before JAX starts

    return stolen_cpu_seconds()


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def format_cpu_seconds(cpu: dict) -> str:
    parts = [f"{k} {v:.1f}" for k, v in sorted(cpu["server"].items(), key=lambda kv: -kv[1]) if v >= 0.05]
    line = f"CPU s in {cpu['wall']:.1f} s: " + ", ".join(parts) + f"; client {cpu['client']:.1f}"
    if stolen_share(cpu) is not None:
        line += f"; stolen by the host {cpu['stolen']:.1f} ({stolen_share(cpu):.0%} of {cpu['cores']} cores)"
    return line


def stolen_share(cpu: dict) -> float | None:
    """The share of the machine's core time the host stole over a CpuSeconds result `cpu`
    (None where it was not recorded)."""
    return cpu["stolen"] / max(cpu["wall"] * cpu["cores"], 1e-9) if "stolen" in cpu else None


# ------------------------------------------------------------------ server


def cpu_busy(seconds: float = 1.0) -> float:
    """The share of the machine's CPU time that was not idle over the next `seconds`
    (jaxllm.platform.busy_cpu_seconds; 0.0 where the OS does not say)."""
    from jaxllm.platform import busy_cpu_seconds  # here: --isa re-runs the script before JAX starts

    start, busy0 = time.perf_counter(), busy_cpu_seconds()
    time.sleep(seconds)
    wall, busy1 = time.perf_counter() - start, busy_cpu_seconds()
    if busy0 is None or busy1 is None:
        return 0.0
    return min(1.0, max(0.0, (busy1 - busy0) / (wall * (os.cpu_count() or 1))))


def wait_for_quiet(busy_below: float = 0.10, at_most_s: float = 60.0) -> None:
    """Until the machine is idle (under `busy_below` of its CPU busy for a second), at most
    `at_most_s`: a server started beside other work (a server before it still exiting)
    would measure its backends in that moment, and its stored plan outlive it (a jaxllm
    start-up in a busy moment right after vLLM's server once chose XLA's dot at 256-448
    rows, 1.6-1.9x too slow: docs/bench-log/2026-12-07-zen3-avx2.md). Says so where it
    waited or gave up."""
    start = time.perf_counter()
    busy = cpu_busy()
    while busy >= busy_below and time.perf_counter() - start < at_most_s:
        busy = cpu_busy()
    waited = time.perf_counter() - start
    if busy >= busy_below:
        print(f"the CPU is still {100 * busy:.0f}% busy after {waited:.0f} s; starting anyway", flush=True)
    elif waited > 1.5:
        print(f"waited {waited:.0f} s for the CPU to go idle", flush=True)


class LaunchedServer:
    """`python -m jaxllm.serve` in a subprocess, for the length of a `with`: started once
    the machine is idle, in a session of its own, and stopped with every process of it
    (a server's workers too, such as vLLM's engine core)."""

    def __init__(self, args: str, log_path: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "jaxllm.serve", "--port", str(self.port), *shlex.split(args)]
        self.log_path = log_path
        self.startup_lines: list[str] = []
        self._drainer: threading.Thread | None = None  # reads the output after ready (_drain)

    def _drain(self, lines) -> None:
        """Keep reading the server's output after ready (a full pipe would block its
        logging, and with it the server), into the log file if one was given, a line at a
        time (line-buffered: the log shows what the server has printed so far)."""
        log = open(self.log_path, "a", buffering=1) if self.log_path else None
        try:
            for line in lines:
                if log:
                    log.write(line)
        finally:
            if log:
                log.close()

    @property
    def engine(self) -> str:
        """The engine's start-up line (dtype, KV cache, weights, the backends its start-up
        plan chose and why), as the server printed it; "" if it printed none."""
        return next((line.strip() for line in self.startup_lines if " loaded in " in line), "")

    def __enter__(self) -> LaunchedServer:
        print("launching:", " ".join(self.cmd), flush=True)
        start = time.perf_counter()
        self.proc = self.launch(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in self.proc.stdout:
            self.startup_lines.append(line)
            if "jaxllm ready" in line:
                break
        else:
            raise RuntimeError(f"server exited with {self.proc.wait()}: {''.join(self.startup_lines[-20:])}")
        # kept, and written to the log: the start-up line says what the engine chose
        if self.log_path:
            Path(self.log_path).write_text("".join(self.startup_lines))
        self._drainer = threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True)
        self._drainer.start()
        self.startup_s = time.perf_counter() - start
        print(f"server ready in {self.startup_s:.1f} s", flush=True)
        return self

    def launch(self, **popen) -> subprocess.Popen:
        """`self.cmd` started (with `popen`'s arguments) once the CPU is idle, in a new
        session: its process group is the server and whatever it starts."""
        wait_for_quiet()
        return subprocess.Popen(self.cmd, start_new_session=True, **popen)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server, then wait until no process of its group is left (its
        workers exit as it shuts them down; SIGKILL to the group past `timeout`): waiting
        for the server process alone could leave a worker still exiting beside the next
        server's start-up."""
        deadline = time.monotonic() + timeout
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        while True:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL if time.monotonic() > deadline else 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._drainer is not None:  # the rest of its output in the log before the caller reads it
            self._drainer.join(10)

    def model(self) -> str:
        return httpx.get(f"{self.url}/v1/models", headers=_auth_headers()).json()["data"][0]["id"]


class LaunchedLlamaServer(LaunchedServer):
    """llama.cpp's llama-server as the baseline: `slots` parallel slots sharing the
    context, as many threads as cores; `extra`: more of its flags."""

    def __init__(self, binary: str, gguf: str, slots: int, ctx_per_slot: int = 1024,
                 log_path: Path | None = None, extra: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__("", log_path)
        self.cmd = [binary, "-m", gguf, "--port", str(self.port), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                    "-t", str(os.cpu_count()), "--cont-batching", *extra]

    def __enter__(self) -> LaunchedServer:
        print("launching:", " ".join(self.cmd), flush=True)
        start = time.perf_counter()
        if self.log_path:
            with open(self.log_path, "w") as log:  # the child keeps its own descriptor
                self.proc = self.launch(stdout=log, stderr=subprocess.STDOUT)
        else:
            self.proc = self.launch(stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        while True:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            time.sleep(0.2)
        self.startup_s = time.perf_counter() - start
        return self


# --------------------------------------------------------------------- plots


def plot(results: dict, out_prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sweep = results.get("sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        conc = [r["max_concurrency"] for r in sweep]
        ax.plot(conc, [r["output_token_throughput"] for r in sweep], "o-", label="output tok/s")
        ax.plot(conc, [r["total_token_throughput"] for r in sweep], "s--", label="total tok/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("tokens / s")
        ax.set_title("throughput against concurrency")
        ax.legend()
        path = out_prefix.with_name(out_prefix.name + "_throughput.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(str(path))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    runs = {f"jaxllm, {name}": run for name, run in results["runs"].items()}
    if results.get("baseline"):  # llama-server on the same requests, the same run
        runs["llama.cpp llama-server"] = results["baseline"]
    for name, run in runs.items():
        for ax, key, label in ((axes[0], "ttft_values_s", "TTFT (s)"), (axes[1], "e2e_values_s", "end-to-end (s)")):
            values = np.sort(run[key])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
    axes[0].set_title("TTFT CDF")
    axes[1].set_title("latency CDF")
    if runs:
        axes[1].legend(fontsize=7)
    path = out_prefix.with_name(out_prefix.name + "_latency_cdf.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    written.append(str(path))
    return written


# ---------------------------------------------------------------------- main


def make_dataset(args, seed: int) -> list[BenchRequest]:
    if args.dataset == "standard":
        return standard_dataset(args.num_prompts or 200, seed, args.vocab_size)
    if args.dataset == "random":
        return random_dataset(args.num_prompts or 200, args.random_input_len, args.random_output_len, seed,
                              args.vocab_size)
    return shared_prefix_dataset(args.num_prompts or 64, seed=seed, vocab=args.vocab_size)


def spec_decode_metrics(url: str) -> dict[str, float]:
    """The server's speculative decoding counters (vllm:spec_decode_*), by name."""
    text = httpx.get(f"{url}/metrics", headers=_auth_headers()).text
    found: dict[str, float] = {}
    for name, labels, value in re.findall(r"^vllm:spec_decode_(\w+?)(?:_total)?\{([^}]*)\} (\S+)$", text, re.M):
        if name.endswith("_created"):  # prometheus-client's timestamp series
            continue
        position = re.search(r'position="(\d+)"', labels)
        found[name + (f"[{position.group(1)}]" if position else "")] = float(value)
    return found


def compare_speculative(args, results: dict, out_prefix: Path) -> None:
    """The same requests without and with speculative decoding, one launched server
    after the other: output throughput ratio, and the drafts' acceptance."""
    requests = make_dataset(args, args.seed)
    base_flags = args.launch or ""
    for label, flags in (("speculation off", base_flags),
                         ("speculation on", f"{base_flags} --speculative-config {shlex.quote(args.compare_speculative)}")):
        log = out_prefix.with_name(out_prefix.name + f"_{label.split()[-1]}_server.log")
        with LaunchedServer(flags, log) as server:
            run = asyncio.run(benchmark(server.url, server.model(), requests,
                                        max_concurrency=args.max_concurrency, request_rate=args.request_rate))
            if label == "speculation on":
                results["spec_decode"] = spec_decode_metrics(server.url)
        results["runs"][label] = run
        print_summary(label, run)
    on, off = results["runs"]["speculation on"], results["runs"]["speculation off"]
    results["output_throughput_ratio"] = on["output_token_throughput"] / off["output_token_throughput"]
    spec = results["spec_decode"]
    drafts = spec.get("num_draft_tokens", 0)
    print(f"\nspeculation on / off, output tokens/s: {results['output_throughput_ratio']:.3f}x; "
          f"{int(drafts)} draft tokens, {spec.get('num_accepted_tokens', 0) / max(drafts, 1):.1%} accepted")


def lora_adapters(args, out_dir: Path) -> list[str]:
    """`--compare-lora` random rank-`--lora-rank` adapters of the launched model's
    shapes (every projection of every layer), written as PEFT folders; name=path each."""
    import importlib.util

    from jaxllm.loaders import load_model

    model = shlex.split(args.launch or "")
    path = model[model.index("--model") + 1] if "--model" in model else None
    cfg = load_model(path, "float32").config
    shapes = dict(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
                  num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers)
    spec = importlib.util.spec_from_file_location("make_test_model", Path(__file__).with_name("make_test_model.py"))
    make_test_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_test_model)
    return [f"lora{i}=" + str(make_test_model.write_lora_adapter(shapes, out_dir / f"lora{i}", rank=args.lora_rank,
                                                                 seed=i, scale=0.02))
            for i in range(args.compare_lora)]


def compare_lora(args, results: dict, out_prefix: Path) -> None:
    """The same requests on the base model alone, then spread round-robin over
    `--compare-lora` adapters of rank `--lora-rank` (one launched server each):
    the output throughput ratio (issue 23's target: >= 0.8x)."""
    requests = make_dataset(args, args.seed)
    modules = lora_adapters(args, out_prefix.parent / "lora_adapters")
    base_flags = args.launch or ""
    lora_flags = (f"{base_flags} --enable-lora --max-loras {args.compare_lora} --max-lora-rank {args.lora_rank} "
                  f"--lora-modules {' '.join(shlex.quote(m) for m in modules)}")
    for label, flags in (("base model", base_flags), (f"{args.compare_lora} adapters", lora_flags)):
        log = out_prefix.with_name(out_prefix.name + f"_{label.split()[-1]}_server.log")
        with LaunchedServer(flags, log) as server:
            models = [m.split("=")[0] for m in modules] if label.endswith("adapters") else server.model()
            run = asyncio.run(benchmark(server.url, models, requests, max_concurrency=args.max_concurrency,
                                        request_rate=args.request_rate))
        results["runs"][label] = run
        print_summary(label, run)
    runs = list(results["runs"].values())
    results["output_throughput_ratio"] = runs[1]["output_token_throughput"] / runs[0]["output_token_throughput"]
    print(f"\n{args.compare_lora} rank-{args.lora_rank} adapters / base model alone, output tokens/s: "
          f"{results['output_throughput_ratio']:.3f}x (target >= 0.8x)")


def compare_launch(args, results: dict, out_prefix: Path) -> None:
    """`--compare-launch`: the same requests on a second launched server (its flags), after
    the first configuration's run; the ratio of the first's output throughput to it."""
    log = out_prefix.with_name(out_prefix.name + "_compare_server.log")
    with LaunchedServer(args.compare_launch, log) as server:
        run = asyncio.run(benchmark(server.url, args.model or server.model(), make_dataset(args, args.seed),
                                    max_concurrency=args.max_concurrency, request_rate=args.request_rate))
    label = f"--compare-launch {args.compare_launch!r}"
    first = next(iter(results["runs"].values()))
    results["runs"][label] = run
    print_summary(label, run)
    results["output_throughput_vs_compare_launch"] = first["output_token_throughput"] / run["output_token_throughput"]
    print(f"\n--launch {args.launch or ''!r} / --compare-launch {args.compare_launch!r}, output tokens/s: "
          f"{results['output_throughput_vs_compare_launch']:.3f}x")


def _joined_launch(argv: list[str]) -> list[str]:
    """`--launch --async-scheduling` as `--launch=--async-scheduling`, `--compare-launch`'s
    value likewise: argparse takes a lone value that starts with a dash for an option (one
    with a space it keeps)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--launch", "--compare-launch") and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: launch one with --launch)")
    p.add_argument("--launch", default=None, help="flags for a `python -m jaxllm.serve` this script starts")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--dataset", choices=["standard", "random", "shared-prefix"], default="standard")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--concurrency-sweep", default=None, help="comma-separated concurrency levels")
    p.add_argument("--isa", choices=sorted(ISAS), default="native", help="avx2: launched servers as on an AVX2-only CPU")
    p.add_argument("--compare-prefix-caching", action="store_true",
                   help="shared-prefix dataset on two launched servers: caching on and off")
    p.add_argument("--compare-speculative", default=None, metavar="JSON",
                   help="the dataset on two launched servers (--launch's flags): without speculative decoding, "
                        "then with --speculative-config JSON; prints the throughput ratio and the acceptance")
    p.add_argument("--compare-lora", type=int, default=0, metavar="N",
                   help="the dataset on the base model alone, then spread over N random LoRA adapters (two launched "
                        "servers, --launch's flags); prints the throughput ratio")
    p.add_argument("--lora-rank", type=int, default=16, help="the rank of --compare-lora's adapters")
    p.add_argument("--compare-launch", default=None, metavar="FLAGS",
                   help="a second launched jaxllm server, these flags, on the same requests after --launch's: "
                        "the output throughput ratio of --launch's to it")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server binary: run the same workload on it first, as the baseline")
    p.add_argument("--llama-gguf", default=None,
                   help="the GGUF llama-server loads (e.g. an F32 export; default: the default model's file, "
                        "where --launch names no --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=49152, help="random token ids are drawn below this (SmolLM2's)")
    p.add_argument("--out", default="bench_results/serving", help="prefix of the JSON and PNG files")
    args = p.parse_args(_joined_launch(sys.argv[1:]))

    if args.compare_launch is not None and (args.base_url or args.concurrency_sweep or args.compare_speculative
                                            or args.compare_lora or args.compare_prefix_caching):
        p.error("--compare-launch compares two launched servers at one concurrency: not with --base-url, "
                "--concurrency-sweep or another --compare-* option")
    if args.llama_server and not args.llama_gguf:
        if "--model" in (args.launch or "") or args.base_url:
            p.error("--llama-server needs --llama-gguf: the GGUF it loads (the server measured here is not "
                    "serving the default model)")
        from jaxllm.loaders import default_model_path

        args.llama_gguf = str(default_model_path())  # the model jaxllm serves by default, the same file
    if not reexec(args.isa):
        return
    print(describe(args.isa), flush=True)
    out_prefix = Path(args.out)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args), "build": describe(args.isa), "runs": {}}

    if args.compare_speculative:
        compare_speculative(args, results, out_prefix)
    elif args.compare_lora:
        compare_lora(args, results, out_prefix)
    elif args.compare_prefix_caching:
        requests = shared_prefix_dataset(args.num_prompts or 64, seed=args.seed, vocab=args.vocab_size)
        base_flags = args.launch or ""
        for label, flag in (("prefix caching on", "--enable-prefix-caching"), ("prefix caching off", "--no-enable-prefix-caching")):
            with LaunchedServer(f"{base_flags} {flag}") as server:
                run = asyncio.run(benchmark(server.url, server.model(), requests,
                                            max_concurrency=args.max_concurrency, request_rate=args.request_rate))
            results["runs"][label] = run
            print_summary(label, run)
        on, off = results["runs"]["prefix caching on"], results["runs"]["prefix caching off"]
        results["ttft_p50_speedup"] = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
        results["total_throughput_speedup"] = on["total_token_throughput"] / off["total_token_throughput"]
        print(f"\nprefix caching: TTFT p50 {results['ttft_p50_speedup']:.1f}x lower, "
              f"total throughput {results['total_throughput_speedup']:.1f}x higher")
    else:
        def run_all(url: str, model: str) -> None:
            levels = [int(c) for c in args.concurrency_sweep.split(",")] if args.concurrency_sweep else [args.max_concurrency]
            for i, level in enumerate(levels):
                # fresh prompts per level, so a level does not hit the previous one's prefix cache
                requests = make_dataset(args, args.seed + i)
                run = asyncio.run(benchmark(url, model, requests, max_concurrency=level, request_rate=args.request_rate))
                label = f"{args.dataset} concurrency={level or 'unbounded'}"
                results["runs"][label] = run
                print_summary(label, run)
            if args.concurrency_sweep:
                results["sweep"] = list(results["runs"].values())

        if args.llama_server:
            slots = max(args.max_concurrency or 32, 1)
            log = out_prefix.with_name(out_prefix.name + "_llama_server.log")
            with LaunchedLlamaServer(args.llama_server, args.llama_gguf, slots, log_path=log) as baseline:
                requests = make_dataset(args, args.seed)
                run = asyncio.run(benchmark(baseline.url, baseline.model(), requests,
                                            max_concurrency=args.max_concurrency, request_rate=args.request_rate))
            results["baseline"] = run
            print_summary(f"llama.cpp llama-server ({slots} slots)", run)

        if args.base_url:
            model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=_auth_headers()).json()["data"][0]["id"]
            run_all(args.base_url, model)
        else:
            with LaunchedServer(args.launch or "", out_prefix.with_name(out_prefix.name + "_server.log")) as server:
                results["server_startup_s"] = server.startup_s
                run_all(server.url, args.model or server.model())
        if args.compare_launch is not None:
            compare_launch(args, results, out_prefix)

    if "baseline" in results and results["runs"]:
        first = next(iter(results["runs"].values()))
        results["output_throughput_vs_llama_cpp"] = first["output_token_throughput"] / results["baseline"]["output_token_throughput"]
        print(f"\njaxllm / llama.cpp output tokens/s: {results['output_throughput_vs_llama_cpp']:.2f}x")

    json_path = out_prefix.with_suffix(".json")
    json_path.write_text(json.dumps(results, indent=2, default=lambda o: asdict(o)))
    print("\nwrote", json_path, *plot(results, out_prefix))


if __name__ == "__main__":
    main()
