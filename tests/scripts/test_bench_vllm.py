"""scripts/bench_vllm.py: its FLOP count against the parameter declaration, and, with the
servers, the HTTP runs and the peak faked, the runs in order, each jaxllm run compared
with vLLM's of its precision, and vLLM skipped (saying why) where it will not install."""

import json
import sys
from pathlib import Path

import bench_vllm
import numpy as np
import pytest
from bench_serving import BenchRequest

from jaxllm.loaders import load_model
from jaxllm.models.params import declarations
from tests.support import server


def test_flops_per_token_are_twice_the_projections_weights(test_models_dir):
    """The layers' matrices and the output projection's, counted from jaxllm's declaration
    (a tied head is the embedding's table)."""
    for name in ("llama", "qwen2"):
        cfg = load_model(test_models_dir / name, dtype="float32").config
        layers = sum(int(np.prod(d.shape)) for d in declarations(cfg)
                     if len(d.shape) == 2 and "vocab" not in d.axes)
        layers_flops, head, attention = bench_vllm.model_flops_per_token(test_models_dir / name)
        assert (layers_flops, head) == (2 * layers, 2 * cfg.vocab_size * cfg.hidden_size)
        assert attention == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


class FakeServer(server.FakeServer):
    launched: list[tuple[str, str]] = []


@pytest.fixture
def faked(monkeypatch, test_models_dir):
    FakeServer.launched = []
    rates = iter([100.0, 150.0, 200.0, 300.0, 320.0, 260.0, 280.0])

    class Jaxllm(FakeServer):
        def __init__(self, flags, log_path=None):
            super().__init__()
            FakeServer.launched.append(("jaxllm", flags))
            self.engine = f"model loaded in 1.0 s; linear cpu [measured] ({flags})"

    class Vllm(FakeServer):
        def __init__(self, python, folder, dtype, max_num_seqs, log_path):
            super().__init__()
            FakeServer.launched.append(("vllm", dtype))

    async def benchmark(url, model, requests, *, max_concurrency, request_rate):
        return {"output_token_throughput": next(rates), "duration_s": 10.0, "tpot_ms": {"p50": 1.0},
                "ttft_ms": {"p50": 2.0}}

    monkeypatch.setattr(bench_vllm, "LaunchedServer", Jaxllm)
    monkeypatch.setattr(bench_vllm, "LaunchedVllmServer", Vllm)
    monkeypatch.setattr(bench_vllm, "benchmark", benchmark)
    monkeypatch.setattr(bench_vllm, "print_summary", lambda title, run: None)
    peaks = iter([{"float32": 1.0, "bfloat16": 2.0, "default": 4.0}, {"float32": 1.5, "bfloat16": 1.0, "default": 3.0}])
    monkeypatch.setattr(bench_vllm, "peak_gflops", lambda: next(peaks))  # before the servers, then after
    monkeypatch.setattr(bench_vllm, "torch_peak_gflops", lambda python: {"float32": 0.5, "bfloat16": 3.0})
    monkeypatch.setattr(bench_vllm, "export_hf_folder", lambda folder, model: test_models_dir / "llama")


def test_each_jaxllm_run_is_compared_with_vllm_at_its_precision(faked, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_vllm, "vllm_python", lambda venv: "python")
    out = tmp_path / "vllm"
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--num-prompts", "3", "--out", str(out)])
    bench_vllm.main()
    assert FakeServer.launched == [("vllm", "float32"), ("jaxllm", bench_vllm.JAXLLM_FLOAT32), ("vllm", "bfloat16"),
                                   ("jaxllm", bench_vllm.JAXLLM_BFLOAT16), ("jaxllm", "--dtype bfloat16"), ("jaxllm", "")]
    table = capsys.readouterr().out
    ratios = [line.split()[-4] for line in table.splitlines() if line.startswith(("vLLM CPU", "jaxllm"))][-6:]
    assert ratios == ["1.00x", "1.50x", "1.00x", "1.50x", "1.60x", "1.30x"]  # defaults against vLLM's bfloat16
    results = json.loads(out.with_suffix(".json").read_text())
    runs = results["runs"]
    assert [r["precision"] for r in runs.values()] == ["float32", "float32", "bfloat16", "bfloat16", "bfloat16",
                                                      "default"]
    # each jaxllm run keeps its server's start-up line (the plan it measured), vLLM's none
    assert [r["engine"] for r in runs.values()][:2] == ["", f"model loaded in 1.0 s; linear cpu [measured] "
                                                             f"({bench_vllm.JAXLLM_FLOAT32})"]
    # each precision's peak: the fastest of jaxllm's / XLA's product and vLLM's torch, before or after the servers
    assert results["peak_gflops"] == {"float32": 1.5, "bfloat16": 3.0, "default": 4.0}
    assert results["peak_sources"]["after"]["jaxllm_or_xla"]["float32"] == 1.5


def test_also_adds_a_jaxllm_run_compared_with_vllms_default(faked, monkeypatch, tmp_path, capsys):
    """`--also FLAGS`: one more jaxllm server after the others (an A/B of a candidate
    default in the same run), its row compared with vLLM's default (bfloat16)."""
    monkeypatch.setattr(bench_vllm, "vllm_python", lambda venv: "python")
    out = tmp_path / "vllm"
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--num-prompts", "3", "--out", str(out),
                                      "--also", "--kv-cache-dtype float32"])
    bench_vllm.main()
    assert FakeServer.launched[-2:] == [("jaxllm", ""), ("jaxllm", "--kv-cache-dtype float32")]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("jaxllm --kv-cache-dtype"))
    assert row.split()[-4] == "1.40x"  # 280 against vLLM's bfloat16 200
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert runs["jaxllm --kv-cache-dtype float32"]["precision"] == "default"


def test_vllm_that_does_not_install_is_skipped(faked, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_vllm, "vllm_python", lambda venv: None)
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--num-prompts", "3", "--out", str(tmp_path / "v")])
    bench_vllm.main()
    assert [server for server, _ in FakeServer.launched] == ["jaxllm"] * 4


def test_the_workload_counts_every_token_and_its_context():
    flops = bench_vllm.workload_flops([BenchRequest([1, 2, 3], 2)], (10.0, 100.0, 1.0))
    assert flops == 5 * 10.0 + 2 * 100.0 + 15  # 5 tokens through the layers, 2 through the head; contexts 1 + ... + 5


def test_under_avx2_vllm_takes_its_avx2_build(monkeypatch):
    """`--isa avx2`: vLLM's environment puts scripts/vllm_avx2 first on PYTHONPATH, whose
    sitecustomize makes torch.cpu's probes answer no AVX-512 and no AMX in every process
    vLLM starts (so it loads _C_AVX2 and skips its AMX paths); natively, nothing added."""
    import subprocess

    from isa_build import ISAS

    monkeypatch.delenv("JAXLLM_CPU_MARCH", raising=False)
    assert "vllm_avx2" not in bench_vllm.vllm_env().get("PYTHONPATH", "")
    monkeypatch.setenv("JAXLLM_CPU_MARCH", ISAS["avx2"]["JAXLLM_CPU_MARCH"])
    env = bench_vllm.vllm_env()
    probe = "import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), " \
            "c._is_amx_tile_supported())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


def test_a_torch_peak_that_fails_is_left_out_saying_why(capsys):
    """Where vLLM's torch cannot run the product, the peaks are jaxllm's / XLA's alone."""
    assert bench_vllm.torch_peak_gflops("false") == {}
    assert "torch's peak not measured" in capsys.readouterr().out


def test_rounds_run_back_and_forth_and_give_each_rounds_ratio(faked, monkeypatch, tmp_path, capsys):
    """`--rounds 2`: the runs, then again in reverse order (a host's drift over the run falls
    on both sides of each comparison); each row's ratio per round against that round's vLLM
    run of its precision, their geometric mean, and the rates' means."""
    monkeypatch.setattr(bench_vllm, "vllm_python", lambda venv: "python")
    rates = iter([100.0, 150.0, 200.0, 300.0, 320.0, 260.0,  # round 1: vLLM float32 ... the defaults
                  240.0, 250.0, 400.0, 180.0, 160.0, 50.0])  # round 2: the defaults ... vLLM float32

    async def benchmark(url, model, requests, *, max_concurrency, request_rate):
        return {"output_token_throughput": next(rates), "duration_s": 10.0, "tpot_ms": {"p50": 1.0},
                "ttft_ms": {"p50": 2.0}}

    monkeypatch.setattr(bench_vllm, "benchmark", benchmark)
    out = tmp_path / "vllm"
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--num-prompts", "3", "--out", str(out), "--rounds", "2"])
    bench_vllm.main()
    assert FakeServer.launched[6:] == FakeServer.launched[:6][::-1]
    rows = {line[:42].strip(): line[42:].split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("vLLM CPU", "jaxllm"))}
    # float32: 150 / 100 in round 1, 160 / 50 in round 2; the mean rate of 150 and 160
    assert rows["jaxllm, float32 (vLLM's precision)"][0] == "155.0"
    float32 = rows["jaxllm, float32 (vLLM's precision)"]
    assert (float32[-7], float32[-4:-2]) == ("2.19x", ["1.50x", "3.20x"])
    assert rows["jaxllm defaults"][-4:-2] == ["1.30x", "1.33x"]  # against vLLM's bfloat16: 260 / 200, 240 / 180
    # each round's share of the cores' time the host stole during the run (read here, so a %)
    if Path("/proc/stat").exists():
        assert all(x.endswith("%") and 0 <= int(x[:-1]) <= 100 for x in float32[-2:])
    results = json.loads(out.with_suffix(".json").read_text())
    assert [len(r) for r in results["rounds"]] == [6, 6]
    assert results["runs"] == results["rounds"][0]


def test_precision_keeps_its_runs_and_the_defaults_baseline():
    """`--precision`: only those rows (and vLLM's bfloat16 where the defaults need it)."""
    def labels(precisions, also=()):
        return [r[0] for r in bench_vllm.selected_runs(precisions, list(also))]

    assert labels(["float32"]) == ["vLLM CPU, float32", "jaxllm, float32 (vLLM's precision)"]
    assert labels(["default"]) == ["vLLM CPU, bfloat16 (its default here)", "jaxllm defaults"]
    assert labels(["float32"], ["--kv-cache-dtype float32"]) == [
        "vLLM CPU, float32", "jaxllm, float32 (vLLM's precision)", "vLLM CPU, bfloat16 (its default here)",
        "jaxllm defaults", "jaxllm --kv-cache-dtype float32"]
    assert labels(None) == [r[0] for r in bench_vllm.RUNS]
