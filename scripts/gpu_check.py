"""One command for the day there is a GPU: the Pallas kernels natively against their
references, the engine with attention_backend="pallas" against "xla", tensor
parallelism over every visible GPU against one, the kernel benchmark and the
throughput benchmark in bfloat16; then one table. Runs end to end on a CPU too
(interpret mode, simulated devices, small sizes), skipping only what needs CUDA and
saying so, so that it cannot rot.

    scripts/gpu_check.sh                 # or: .venv/bin/python scripts/gpu_check.py
    scripts/gpu_check.sh --out gpu_check.json

On a CUDA machine: `pip install -e '.[cuda12]'` (or the image's JAX with CUDA) first;
on one with no package index, the rest as wheels (`scripts/gpu_wheels.sh` here, then
its install line there). `--deadline SECONDS` fits a short lease: checks run most
telling first, each cut to the time left, and `--out` is rewritten after every one.
Every check runs in its own subprocess, with a time limit; the exit status is non-zero
if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Check:
    name: str
    cmd: list[str] | None  # None: skipped (`why` says why)
    why: str = ""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout: float = 1800
    pick: tuple[str, ...] = ()  # the output lines (starting so) the table shows, else the last one
    full_model: bool = False  # needs all 16 layers of Llama-3.2-1B's shapes (made on first use)


@dataclasses.dataclass
class Result:
    name: str
    status: str  # pass | FAIL | skipped
    seconds: float
    detail: str


def platform() -> tuple[str, int, str]:
    """(JAX's default backend, its device count, the first device's kind), asked in a
    subprocess so this process never initializes a backend."""
    code = "import jax; d = jax.devices(); print(jax.default_backend(), len(d), d[0].device_kind, sep='|')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    backend, n, kind = out.stdout.strip().splitlines()[-1].split("|")
    return backend, int(n), kind


def checks(backend: str, num_devices: int, models: Path) -> list[Check]:
    py, gpu = sys.executable, backend == "gpu"
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    tp = max(n for n in (1, 2, 4, 8) if n <= num_devices) if gpu else 2
    tp_model = models / ("llama-3.2-1b" if gpu else "llama")
    # float32 at full matmul precision on both sides: the check is of the sharding, and
    # bfloat16 (or TF32) rounding in another summation order could flip a greedy token
    tp_code = (f"import tests.support.multidevice as m; m.tp_engine_matches({str(tp_model)!r}, '{tp}', 'auto', 'float32')"
               if gpu else f"import tests.support.multidevice as m; print(m.run('tp_engine_matches', {str(tp_model)!r}, "
                           f"'2', devices=2))")
    # on a GPU the slow engine-step replay too, not the full grid (~1.5 s of compile a case)
    dump = os.environ.get("GPU_CHECK_DUMP", "")  # a folder for the first differing attention call's inputs
    kernel_tests = pytest + ["tests/kernels/test_pallas_ragged_paged_attention.py"] + (
        ["-m", "", "-k", "not full_grid"] if gpu else ["-k", "matches_reference"])
    small = models / ("llama-3.2-1b" if gpu else "llama")
    full = str(models / "llama-3.2-1b-full")
    tokens_code = f"import tests.support.multidevice as m; m.platform_tokens_match({str(small)!r})"
    q8_0_code = (f"import tests.support.multidevice as m; "
                 f"m.platform_tokens_match({str(small)!r}, quantization='q8_0', attention='xla')")
    # on a GPU the defaults alone: each engine compiles its ~19 buckets (~13 s each on the H200),
    # so the async / single-step comparisons (two more engines) do not fit a lease
    throughput = ([py, "scripts/bench_throughput.py", "--skip-startup", "--skip-hf", "--attention-backend", "pallas",
                   "--model", full] if gpu else
                  [py, "scripts/bench_throughput.py", "--num-requests", "16", "--skip-startup", "--skip-hf",
                   "--compare-async"])
    # issue 57's figures: host work and the device's idle share per decode step at 64 and 256
    # sequences, single steps against multi-step decode (4, the default; 8 did not fit the
    # H200's lease on 2026-12-04); batch-1 decode against the weights' read floor
    host = ([py, "scripts/bench_host.py", "--model", full, "--dtype", "bfloat16", "--seqs", "64,256",
             "--async-scheduling", "on", "--decode-steps", "4,1", "--steps", "32", "--kv-cache-memory", "8GiB"]
            if gpu else [py, "scripts/bench_host.py", "--layers", "1", "--seqs", "1,64", "--async-scheduling", "on",
                         "--decode-steps", "1,4", "--steps", "16"])
    # most telling first (`FIRST`, then this order), each with a time limit (a device lease is
    # short): what has not yet run on a GPU first; what passed on the H200 (2026-11-27, -30) later
    return prioritized([
        Check("mosaic gpu attention, quantized matmul and KV write vs reference" + (" (natively)" if gpu else
                                                                          " (its interpreter)"),
              pytest + ["tests/kernels/test_mosaic_attention.py", "tests/kernels/test_mosaic_quantized_matmul.py",
                        "tests/kernels/test_mosaic_kv_cache_write.py", "-m", ""],
              env={"JAXLLM_PALLAS_INTERPRET": "0" if gpu else "1"}, timeout=240),
        Check("bench_kernels.py --sweep: mosaic gpu and triton attention (llama-3.1-8b shapes)",
              [py, "scripts/bench_kernels.py", "--model", "llama-3.1-8b", "--sweep", "--peak-bw-tbs", "4.8"]
              if gpu else None, "needs CUDA: in interpret mode it would time the interpreter", timeout=300,
              pick=("measured copy rate", "[", "    ")),
        Check("bench_quantized_matmul.py --sweep (llama-3.1-8b projections, one row; triton and mosaic gpu)",
              [py, "scripts/bench_quantized_matmul.py", "--sweep", "--rows", "1", "--formats", "int8,q4_1"]
              if gpu else None, "needs CUDA: in interpret mode it would time the interpreter", timeout=300,
              pick=("|", "  fastest")),
        Check("bench_host.py: host work and device idle per decode step" + (" (llama-3.2-1b shapes, bfloat16)"
                                                                            if gpu else " (CPU, tiny model)"),
              host, timeout=420, pick=("layers/seqs", "llama-3.2-1b-full/", "1L/"), full_model=gpu),
        Check("bench_batch1.py: batch-1 decode against the weights' read floor (llama-3.2-1b shapes)",
              [py, "scripts/bench_batch1.py", "--model", full, "--decode-steps", "1,8"] if gpu else None,
              "the CPU's is in make bench (SmolLM2)", timeout=300, pick=("num_scheduler_steps",), full_model=gpu),
        Check("engine: pallas == xla, greedy tokens (float32)", pytest + ["tests/kernels/test_pallas_engine.py", "-m", ""],
              env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"}, timeout=180),  # else XLA's float32 dot is TF32
        Check("pallas quantized matmul vs reference, and as linear_backend='pallas' through the engine",
              pytest + ["tests/kernels/test_pallas_quantized_matmul.py", "-m", ""],
              env={"JAXLLM_PALLAS_INTERPRET": "0" if gpu else "1", "JAX_DEFAULT_MATMUL_PRECISION": "highest"},
              timeout=240),
        Check(("GPU (pallas)" if gpu else "default platform (pallas)") + " == CPU (xla): tokens, logprobs",
              [py, "-c", tokens_code], timeout=240, pick=("ok",)),
        Check("GPU == CPU with Q8_0 weights (XLA's dot on int8 values)",
              [py, "-c", q8_0_code] if gpu else None,
              "the CPU runs it in tests/models/test_quant.py", timeout=240, pick=("ok",)),
        Check("bench_throughput.py" + (" (bfloat16, llama-3.2-1b shapes, pallas)" if gpu else " (CPU, 16 requests)"),
              throughput, timeout=480, pick=("jaxllm:", "MFU", "steps:", "time:", "host gap", "async",
                                             "jaxllm, num_scheduler_steps"),
              full_model=gpu),
        Check("pallas LoRA (shrink/expand) vs reference", pytest + ["tests/kernels/test_pallas_lora.py"],
              env={"JAXLLM_PALLAS_INTERPRET": "0" if gpu else "1"}, timeout=180),
        Check("engine's attention calls replayed: kernel == reference",
              [py, "-c", f"import tests.support.multidevice as m; m.pallas_engine_calls_match({str(models / 'llama')!r}, "
                         f"dump={dump!r})"],
              timeout=180, pick=("ok",)),
        Check("pallas kernels vs reference" + ("" if gpu else " (interpret mode)"), kernel_tests,
              env={"JAXLLM_PALLAS_INTERPRET": "0" if gpu else "1"}, timeout=240),
        Check("pallas kernels lower for CUDA", pytest + ["tests/kernels/test_pallas_lowering.py"], timeout=180),
        Check(f"tensor parallel {tp} == 1 device" + ("" if gpu else " (simulated CPU devices)"),
              [py, "-c", tp_code] if tp > 1 else None, "one GPU: nothing to shard over",
              env={"JAX_DEFAULT_MATMUL_PRECISION": "highest"}, timeout=300),
        Check("tensor-parallel forward lowers for 8 GPUs",
              None if gpu else pytest + ["tests/models/test_tensor_parallel.py", "-k", "lowers"],
              "a CPU check (simulated devices): the default test suite runs it", timeout=180),
    ])


# Unmeasured on a GPU when the H200 lease of 2026-11-30 ran out (a bucket of the 1B model
# compiled in ~13 s there: the engine checks get several minutes each).
FIRST = ("bench_host", "bench_throughput", "bench_quantized_matmul", "bench_batch1")


def prioritized(all_checks: list[Check]) -> list[Check]:
    """The checks named in FIRST first, in its order; the rest in theirs."""
    rank = lambda c: next((i for i, p in enumerate(FIRST) if c.name.startswith(p)), len(FIRST))
    return sorted(all_checks, key=rank)


def make_models(models: Path, gpu: bool, full: bool = False) -> None:
    """The test models the checks use: the tiny llama (and, on a GPU, Llama-3.2-1B's
    shapes: 2 layers for the TP check); with `full`, all 16 layers for the throughput
    benchmark (made only when a check that needs them runs)."""
    script = ROOT / "scripts" / "make_test_model.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), *a], check=True, capture_output=True)
    if full:
        if gpu and not (models / "llama-3.2-1b-full").exists():
            run(str(models / "full"), "--arch", "llama-3.2-1b")
            (models / "full" / "llama-3.2-1b").rename(models / "llama-3.2-1b-full")
        return
    run(str(models), "--arch", "llama")
    if gpu:
        run(str(models), "--arch", "llama-3.2-1b", "--layers", "2")


def run_check(check: Check, seconds_left: float, log: Path | None = None) -> Result:
    if check.cmd is None:
        return Result(check.name, "skipped", 0.0, check.why)
    if seconds_left < 30:
        return Result(check.name, "skipped", 0.0, "out of time (--deadline)")
    check = dataclasses.replace(check, timeout=min(check.timeout, seconds_left))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **check.env)
    start = time.perf_counter()
    # its own process group, killed whole on a timeout: a benchmark's grandchild left running
    # would keep its GPU memory (XLA takes 75%) and every later check would run out of it
    proc = subprocess.Popen(check.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=check.timeout)
        _append(log, check.name, stdout + stderr)
        status = "pass" if proc.returncode == 0 else "FAIL"
        picked = [ln.strip() for ln in stdout.splitlines() if check.pick and ln.startswith(check.pick)]
        lines = [ln for ln in (stdout + "\n" + stderr).splitlines() if ln.strip()]
        detail = " / ".join(" ".join(ln.split()) for ln in picked) if picked and status == "pass" else _summary(lines, status)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        _append(log, check.name + " (timed out)", _text(stdout) + _text(stderr))
        status, detail = "FAIL", f"timed out after {check.timeout:.0f} s"
    return Result(check.name, status, time.perf_counter() - start, detail)


def _append(log: Path | None, name: str, output: str) -> None:
    """A check's whole output, under its name, at the end of `--log`."""
    if log is not None:
        with log.open("a") as f:
            f.write(f"===== {name}\n{output}\n")


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _summary(lines: list[str], status: str) -> str:
    """The line that says the most: pytest's count, a benchmark's last line, an error."""
    for ln in reversed(lines):
        if status == "FAIL" and ("Error" in ln or "FAILED" in ln or "assert" in ln):
            return ln.strip()[:160]
        if " passed" in ln or " failed" in ln:
            return ln.strip()[:160]
    return lines[-1].strip()[:160] if lines else ""


def table(results: list[Result], machine: str) -> str:
    rows = [f"machine: {machine}", "", "| check | result | s | detail |", "|---|---|---:|---|"]
    rows += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.detail} |" for r in results]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON (after every check)")
    p.add_argument("--log", type=Path, default=None, help="append every check's whole output to this file")
    p.add_argument("--only", default=None,
                   help="run the checks whose name contains one of these (comma-separated), in this order")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole run: each check's limit is cut to what is left, later ones skipped")
    args = p.parse_args()
    start = time.perf_counter()
    left = lambda: (args.deadline or float("inf")) - (time.perf_counter() - start)
    backend, n, kind = platform()
    machine = f"{backend}, {n} x {kind}"
    print(f"gpu_check on {machine}" + ("" if backend == "gpu" else ": no GPU, CUDA-only parts skipped"), flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        models = Path(tmp)
        make_models(models, backend == "gpu")
        results = []
        for check in selected(checks(backend, n, models), args.only):
            print(f"... {check.name}", flush=True)
            budget = left()
            if check.full_model and check.cmd is not None:  # its model first, if there is time for both
                budget = budget if budget > 120 else 0  # (run_check skips a check with no time)
                if budget:
                    make_models(models, backend == "gpu", full=True)
            results.append(run_check(check, left() if budget else 0, args.log))
            print(f"    {results[-1].status} ({results[-1].seconds:.0f} s) {results[-1].detail}", flush=True)
            if args.out:
                rows = [dataclasses.asdict(r) for r in results]
                args.out.write_text(json.dumps({"machine": machine, "results": rows}, indent=1))
    print()
    print(table(results, machine))
    sys.exit(1 if any(r.status == "FAIL" for r in results) else 0)


def selected(all_checks: list[Check], only: str | None) -> list[Check]:
    """The checks `--only` names (substrings, comma-separated), in its order; all without it."""
    if not only:
        return all_checks
    names = [x.strip() for x in only.split(",") if x.strip()]
    picked = [c for name in names for c in all_checks if name in c.name]
    return [c for i, c in enumerate(picked) if c not in picked[:i]]  # each once, where first named


if __name__ == "__main__":
    main()
