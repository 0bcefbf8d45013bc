#!/usr/bin/env python
"""jaxllm against vLLM's own CPU build, side by side in one run (issue 59).

The same requests (the standard dataset's first 64 at 32 clients by default) on each
server, one after the other, the same client (scripts/bench_serving.py):

- vLLM CPU in float32, then jaxllm in float32 exactly (`--dtype float32 --quantization
  none --activation-quantization none`): equal precision;
- vLLM CPU in bfloat16 (its default for SmolLM2, a bfloat16 checkpoint), then jaxllm
  `--dtype bfloat16 --quantization none`: equal precision;
- jaxllm `--dtype bfloat16` (the embedded file's Q4_1 blocks kept, multiplied in
  bfloat16, a bfloat16 KV cache), against the same;
- jaxllm's defaults (the embedded Q4_1 file), against vLLM's default (bfloat16).

vLLM reads HF folders, not GGUF: both serve the embedded SmolLM2 exported as one
(`build/smollm2-hf`, the float32 weights jaxllm's `--quantization none` holds). vLLM
runs from its own venv (scripts/build_vllm_cpu.sh); where it will not install, this
prints why and measures jaxllm alone.

Each run's arithmetic rate (the layers' multiply-adds of every prompt and output token,
the output projection's of every output token, attention's over the context, per second;
a prefix-cache hit counts as served) is printed beside the peak of its
precision, measured in the same run before the servers start and again after them (a
512 x 2048 x 2048 product, float32 and bfloat16 by the fastest of XLA's dot, jaxllm's cpu
kernel and vLLM's torch (`peak_gflops`, `torch_peak_gflops`); the defaults' Q4_1 blocks by
the kernel, with the activations `auto` gives). A peak is the best call of each, and the
higher of the two measurements: a shared host's other tenants only ever slow a call
down, so a median, or one moment of the run, would understate the peak and overstate
every share of it. Each run also records who used the cores (`cpu_s`): the CPU
seconds of the server's processes (frontend, engine) and of this client over the run, and
those the hypervisor stole from the machine's cores (the table's last column: a run its host
left about one core of two is told apart from the engine's own speed).

A shared host's speed drifts over a run by more than the margins measured here. With
`--rounds N` the runs are repeated, every other round in reverse order, so that the drift
falls on both sides of each comparison; each jaxllm run's ratio is then given per round
(against that round's vLLM run) and as their geometric mean, its rates as means.

    python scripts/bench_vllm.py --out bench_results/vllm_standard
    python scripts/bench_vllm.py --isa avx2 --out bench_results/vllm_standard_avx2  # both as on an AVX2-only CPU
    python scripts/bench_vllm.py --rounds 2 --out bench_results/vllm_standard   # vLLM, jaxllm, ..., then back
    python scripts/bench_vllm.py --precision float32 --rounds 4 --out bench_results/vllm_float32  # one pair, 4x
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from bench_eval import export_hf_folder
from bench_serving import CpuSeconds, LaunchedServer, benchmark, print_summary, standard_dataset, stolen_share
from isa_build import ISAS, describe, reexec

ROOT = Path(__file__).resolve().parents[1]
JAXLLM_FLOAT32 = "--dtype float32 --quantization none --activation-quantization none"
JAXLLM_BFLOAT16 = "--dtype bfloat16 --quantization none"
# (label, server, flags, precision); a jaxllm run is compared with the vLLM run of its precision
RUNS = (("vLLM CPU, float32", "vllm", "float32", "float32"),
        ("jaxllm, float32 (vLLM's precision)", "jaxllm", JAXLLM_FLOAT32, "float32"),
        ("vLLM CPU, bfloat16 (its default here)", "vllm", "bfloat16", "bfloat16"),
        ("jaxllm, bfloat16 (vLLM's precision)", "jaxllm", JAXLLM_BFLOAT16, "bfloat16"),
        ("jaxllm --dtype bfloat16 (Q4_1 blocks kept)", "jaxllm", "--dtype bfloat16", "bfloat16"),
        ("jaxllm defaults", "jaxllm", "", "default"))


class LaunchedVenvServer(LaunchedServer):
    """A baseline's HTTP server run from its own venv (`cmd`, with `env`), its output to
    `log_path`, ready when GET /health answers 200; `name` says whose it is."""

    name = "server"

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        super().__init__("", log_path)
        self.cmd, self.env = cmd, env

    def __enter__(self) -> LaunchedServer:
        print("launching:", " ".join(self.cmd), flush=True)
        start = time.perf_counter()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = self.launch(stdout=log, stderr=subprocess.STDOUT, env=self.env)
        while not _healthy(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (see {self.log_path})")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - start
        print(f"{self.name} ready in {self.startup_s:.1f} s", flush=True)
        return self


class LaunchedVllmServer(LaunchedVenvServer):
    """vLLM's OpenAI server from its venv, on both cores, `dtype`, 2 GiB of KV cache."""

    name = "vLLM"

    def __init__(self, python: str, folder: Path, dtype: str, max_num_seqs: int, log_path: Path) -> None:
        super().__init__([], vllm_env(), log_path)
        self.cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", dtype,
                    "--port", str(self.port), "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs)]


def vllm_env() -> dict[str, str]:
    """vLLM CPU's environment here: 2 GiB of KV cache, its OpenMP threads on every core;
    under `--isa avx2` (isa_build's environment set) also its AVX2 build and code paths
    (scripts/vllm_avx2/sitecustomize.py: torch.cpu's probes answer no AVX-512, no AMX)."""
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    if os.environ.get("JAXLLM_CPU_MARCH") == ISAS["avx2"]["JAXLLM_CPU_MARCH"]:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "scripts" / "vllm_avx2"),
                                                          os.environ.get("PYTHONPATH")]))
    return env


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def venv_python(build_script: str, venv: str, what: str) -> str | None:
    """The python of a baseline's venv, built by `scripts/<build_script>` (which prints
    it, or says why it cannot build), or None, saying `what` is skipped and why."""
    proc = subprocess.run([str(ROOT / "scripts" / build_script), venv], capture_output=True, text=True)
    if proc.returncode:
        print(f"{what} is skipped: {proc.stderr.strip()}", flush=True)
        return None
    return proc.stdout.strip().splitlines()[-1]


def vllm_python(venv: str) -> str | None:
    """The vLLM venv's python (built by scripts/build_vllm_cpu.sh), or None, saying why."""
    return venv_python("build_vllm_cpu.sh", venv, "vLLM's CPU build")


def model_flops_per_token(folder: Path) -> tuple[float, float, float]:
    """(the layers' projections' FLOPs per token, the output projection's, attention's per
    token per token of context) of the HF folder's model: 2 per multiply-add."""
    cfg = json.loads((folder / "config.json").read_text())
    d, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or d // heads
    per_layer = d * (heads + 2 * kv_heads) * hd + heads * hd * d + 3 * d * f
    return 2 * layers * per_layer, 2 * d * cfg["vocab_size"], 2 * 2 * layers * heads * hd  # q.k and p.v


def workload_flops(requests, flops: tuple[float, float, float]) -> float:
    """The FLOPs of serving `requests`: every prompt and output token through the layers
    (a prefix-cache hit is not subtracted: the rate is per token served), the output
    projection once per output token, attention over each token's context."""
    layers, head, attention = flops
    total = 0.0
    for req in requests:
        n = len(req.prompt) + req.output_len
        total += n * layers + req.output_len * head + attention * n * (n + 1) / 2
    return total


PEAK_SHAPE = (512, 2048, 2048)  # M x K x N of the product each precision's peak is measured on


def peak_gflops() -> dict[str, float]:
    """Per precision, the best rate of a 512 x 2048 x 2048 product (GFLOP/s, the best call
    of 10 after a warm-up: `_best_seconds`): float32 and bfloat16 by XLA's dot or jaxllm's cpu kernel (bfloat16
    on AMX's tiles where the CPU has them), whichever is faster; the defaults' Q4_1 blocks
    by the kernel with the activations auto gives here (bfloat16 on AMX, else int16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import cpu_kernels
    from jaxllm.models.linear import auto_activations, linear, pack_weight
    from jaxllm.models.quant import quantize_weight

    m, k, n = PEAK_SHAPE
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) / 45
    xla = jax.jit(lambda x, w: jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32))
    kernel = jax.jit(lambda x, p: linear(x, p))
    tiles = "amx" if cpu_kernels.has_amx() else "dot"
    candidates = {name: [(xla, jnp.asarray(w, name)), (kernel, pack_weight(jnp.asarray(w, name)).replace(
        bf16_tiles=tiles))] for name in ("float32", "bfloat16")}
    q4_1 = quantize_weight(w, "q4_1")
    default = auto_activations()  # what the defaults multiply the blocks in here
    candidates["default"] = [(kernel, pack_weight(q4_1.replace(float_dtype="bfloat16")).replace(bf16_tiles=tiles)
                              if default == "bfloat16" else pack_weight(q4_1.replace(activations=default or "float")))]
    return {name: max(2 * m * k * n / _best_seconds(fn, x, arg) / 1e9 for fn, arg in pairs)
            for name, pairs in candidates.items()}


TORCH_PEAK = """
import json, sys, time, torch
m, k, n = map(int, sys.argv[1:])
out = {}
for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    times = []
    while len(times) < 10 and (len(times) < 2 or sum(times) < 5):  # torch's bfloat16 takes 15 s a call on AVX2
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    out[name] = 2 * m * k * n / min(times) / 1e9
print(json.dumps(out))
"""


def torch_peak_gflops(python: str) -> dict[str, float]:
    """The same product (PEAK_SHAPE) by the baseline's torch (oneDNN, which on AMX can
    outrun the kernel: docs/benchmarks.md), float32 and bfloat16, the best of 10 calls
    (of 2 where they take over 5 s), in
    vLLM's venv with its environment; {} (saying why) where it fails."""
    proc = subprocess.run([python, "-c", TORCH_PEAK, *map(str, PEAK_SHAPE)], capture_output=True, text=True,
                          env=vllm_env())
    try:
        return {k: float(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    except (IndexError, ValueError, AttributeError) as e:
        print(f"torch's peak not measured ({e}): {proc.stderr.strip()[-300:]}", flush=True)
        return {}


def measure_peaks(python: str | None, when: str) -> dict[str, dict[str, float]]:
    """Each precision's peak by jaxllm / XLA and by the baseline's torch (where it
    installed), printed: {"jaxllm_or_xla": {...}, "torch": {...}}."""
    own = peak_gflops()
    torch_peaks = torch_peak_gflops(python) if python is not None else {}
    print(f"peak GFLOP/s {when} the servers (a {' x '.join(map(str, PEAK_SHAPE))} product): jaxllm / XLA",
          {k: round(v) for k, v in own.items()}, "torch", {k: round(v) for k, v in torch_peaks.items()}, flush=True)
    return {"jaxllm_or_xla": own, "torch": torch_peaks}


def best_peaks(measured) -> dict[str, float]:
    """Per precision, the highest of the measurements' (each `measure_peaks`' result)."""
    peaks: dict[str, float] = {}
    for sources in measured:
        for by in sources.values():
            for k, v in by.items():
                peaks[k] = max(peaks.get(k, 0.0), v)
    return peaks


def _best_seconds(fn, *args, calls: int = 10) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=sorted(ISAS), default="native",
                   help="avx2: both servers as on an AVX2-only CPU (jaxllm's kernels built for x86-64-v3 and XLA "
                        "capped: scripts/isa_build.py; vLLM's AVX2 library and torch capped)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--vllm-venv", default=str(ROOT / "build" / "vllm-cpu"))
    p.add_argument("--hf-folder", type=Path, default=ROOT / "build" / "smollm2-hf")
    p.add_argument("--out", default="bench_results/vllm_standard", help="prefix of the JSON file and logs")
    p.add_argument("--also", action="append", default=[], metavar="FLAGS",
                   help="one more jaxllm run with these flags, after the others, compared with vLLM's default "
                        "(an A/B of a candidate default in the same run); repeatable")
    p.add_argument("--precision", action="append", choices=("float32", "bfloat16", "default"),
                   help="only the runs of this precision (repeatable; the defaults bring vLLM's bfloat16 run, "
                        "their baseline): e.g. `--precision float32 --rounds 4`, more rounds of one comparison "
                        "in the time of a whole run")
    p.add_argument("--rounds", type=int, default=1,
                   help="the runs this many times, every other round in reverse order (so a host's drift over the "
                        "run falls on both sides of each comparison); each ratio per round, and their geometric mean")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    if not reexec(args.isa):
        return
    runs = selected_runs(args.precision, args.also)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(describe(args.isa), flush=True)
    folder = export_hf_folder(args.hf_folder, None)
    requests = standard_dataset()[:args.num_prompts]
    flops = model_flops_per_token(folder)
    python = vllm_python(args.vllm_venv)
    results: dict = {"build": describe(args.isa), "peak_sources": {"before": measure_peaks(python, "before")},
                     "rounds": []}
    for r in range(args.rounds):
        order = list(enumerate(runs))
        results["rounds"].append({})
        for i, (label, server, flags, precision) in order if r % 2 == 0 else reversed(order):
            if server == "vllm" and python is None:
                continue
            log = out.with_name(f"{out.name}_{i}_{server}" + (f"_round{r + 1}" if args.rounds > 1 else "") + ".log")
            run = serve_and_measure(server, flags, python, folder, args.max_concurrency, requests, log)
            run |= {"precision": precision, "gflops": workload_flops(requests, flops) / run["duration_s"] / 1e9}
            results["rounds"][r][label] = run
            print_summary(label + (f" (round {r + 1})" if args.rounds > 1 else ""), run)
    results["runs"] = {label: results["rounds"][0][label] for label, *_ in runs if label in results["rounds"][0]}
    results["peak_sources"]["after"] = measure_peaks(python, "after")
    results["peak_gflops"] = best_peaks(results["peak_sources"].values())
    print_table(results)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print("wrote", out.with_suffix(".json"))


def selected_runs(precisions: list[str] | None, also: list[str]) -> tuple:
    """RUNS of these precisions (all without any), then a run per `--also` flags. An `--also`
    run is a candidate default, so it brings the defaults' runs (the A/B it is for); the
    defaults bring vLLM's bfloat16 run, their baseline."""
    extra = tuple((f"jaxllm {flags}", "jaxllm", flags, "default") for flags in also)
    wanted = set(precisions or ("float32", "bfloat16", "default")) | ({"default"} if extra else set())
    defaults_baseline = {"bfloat16"} if "default" in wanted else set()
    return tuple(r for r in RUNS if r[3] in wanted or (r[1] == "vllm" and r[3] in defaults_baseline)) + extra


def serve_and_measure(server: str, flags: str, python: str | None, folder: Path, max_concurrency: int, requests,
                      log: Path) -> dict:
    """One server launched (vLLM with `flags` its dtype, else jaxllm with them), the requests run
    against it, and who used the cores meanwhile."""
    launched = (LaunchedVllmServer(python, folder, flags, max_concurrency, log) if server == "vllm"
                else LaunchedServer(flags, log))
    with launched:
        model = launched.model()
        with CpuSeconds(launched.proc.pid) as cpu:
            run = asyncio.run(benchmark(launched.url, model, requests, max_concurrency=max_concurrency,
                                        request_rate=float("inf")))
    if launched.engine:  # what its start-up chose (the backends it measured): a slow row can be told apart
        print(launched.engine, flush=True)
    return run | {"server": server, "flags": flags, "cpu_s": cpu.result, "engine": launched.engine}


def round_ratios(results: dict, label: str) -> list[float]:
    """The run's output rate over its vLLM run's (the same precision; the defaults against vLLM's
    bfloat16) in each round that has both; vLLM's own runs 1."""
    ratios = []
    for runs in results["rounds"]:
        run = runs.get(label)
        vllm = {r["precision"]: r for r in runs.values() if r["server"] == "vllm"}
        vllm["default"] = vllm.get("bfloat16")
        base = run and (vllm.get(run["precision"]) if run["server"] == "jaxllm" else run)
        if base:
            ratios.append(run["output_token_throughput"] / base["output_token_throughput"])
    return ratios


def print_table(results: dict) -> None:
    """A row per run: its output rate, latencies, rate against vLLM's and share of its precision's
    peak, the means over the rounds where there are several, with each round's ratio and the
    share of the cores' time the host stole during each round's run."""
    peaks, rounds = results["peak_gflops"], results["rounds"]
    print(f"\n{'server':<42} {'output tok/s':>12} {'TPOT p50':>9} {'TTFT p50':>9} {'vs vLLM':>8} {'GFLOP/s':>8}"
          f" {'of peak':>8}" + ("  vs vLLM by round" if len(rounds) > 1 else "") + "  stolen")
    for label in results["runs"]:
        runs = [r[label] for r in rounds if label in r]
        mean = {k: float(np.mean([r[k] for r in runs])) for k in ("output_token_throughput", "gflops")}
        tpot, ttft = (float(np.mean([r[k]["p50"] for r in runs])) for k in ("tpot_ms", "ttft_ms"))
        ratios = round_ratios(results, label)
        ratio = f"{float(np.exp(np.mean(np.log(ratios)))):.2f}x" if ratios else "-"
        by_round = "  " + " ".join(f"{x:.2f}x" for x in ratios) if len(rounds) > 1 else ""
        shares = [stolen_share(r.get("cpu_s", {})) for r in runs]
        stolen = " ".join("-" if share is None else f"{share:.0%}" for share in shares)
        print(f"{label:<42} {mean['output_token_throughput']:>12.1f} {tpot:>7.0f}ms {ttft:>7.0f}ms {ratio:>8} "
              f"{mean['gflops']:>8.0f} {mean['gflops'] / peaks[runs[0]['precision']]:>7.0%}{by_round}  {stolen}")



if __name__ == "__main__":
    sys.exit(main())
