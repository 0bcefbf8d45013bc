"""scripts/bench_serving.py's --compare-launch, with the servers and the HTTP runs faked:
the two launches in order with their flags, the same requests to both, the ratio of
the first's output throughput to the second's; combinations it cannot compare refused."""

import json
import sys
import time
from pathlib import Path

import bench_serving
import pytest

from tests.support import server


class FakeServer(server.FakeServer):
    launched: list[str] = []

    def __init__(self, args: str, log_path=None) -> None:
        super().__init__()
        self.args = args
        FakeServer.launched.append(args)


@pytest.fixture
def faked(monkeypatch):
    FakeServer.launched = []
    seen = []

    async def benchmark(url, model, requests, *, max_concurrency, request_rate, seed=0):
        seen.append([(r.prompt, r.output_len) for r in requests])
        return {"output_token_throughput": 300.0 if url.endswith("/0") else 150.0}

    monkeypatch.setattr(bench_serving, "LaunchedServer", FakeServer)
    monkeypatch.setattr(bench_serving, "benchmark", benchmark)
    monkeypatch.setattr(bench_serving, "print_summary", lambda title, run: None)
    monkeypatch.setattr(bench_serving, "plot", lambda results, prefix: [])
    return seen


def test_compare_launch_runs_both_on_the_same_requests(faked, monkeypatch, tmp_path):
    out = tmp_path / "serving"
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--launch", "--model a.gguf", "--compare-launch",
                                      "--model a.gguf --quantization none", "--dataset", "random",
                                      "--num-prompts", "3", "--random-input-len", "5", "--random-output-len", "4",
                                      "--max-concurrency", "1", "--out", str(out)])
    bench_serving.main()
    assert FakeServer.launched == ["--model a.gguf", "--model a.gguf --quantization none"]
    assert len(faked) == 2 and faked[0] == faked[1] and len(faked[0]) == 3
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["output_throughput_vs_compare_launch"] == 2.0
    assert list(results["runs"]) == ["random concurrency=1", "--compare-launch '--model a.gguf --quantization none'"]


@pytest.mark.parametrize("other", [["--concurrency-sweep", "1,2"], ["--base-url", "http://x"],
                                   ["--compare-prefix-caching"]])
def test_compare_launch_refuses_what_it_cannot_compare(faked, monkeypatch, capsys, other):
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--compare-launch", "--x 1", *other])
    with pytest.raises(SystemExit) as e:
        bench_serving.main()
    assert e.value.code == 2
    assert "--compare-launch compares two launched servers" in capsys.readouterr().err
    assert FakeServer.launched == []


def test_joined_launch_keeps_dash_values():
    assert bench_serving._joined_launch(["--launch", "--async-scheduling", "--compare-launch", "--dtype x",
                                         "--out", "o"]) == [
        "--launch=--async-scheduling", "--compare-launch=--dtype x", "--out", "o"]


class FakeLlamaServer(FakeServer):
    loaded: list[str] = []

    def __init__(self, binary: str, gguf: str, slots: int, log_path=None) -> None:
        super().__init__("llama-server")
        FakeLlamaServer.loaded.append(gguf)


def test_llama_server_loads_the_default_model_s_file_unless_told(faked, monkeypatch, capsys, tmp_path):
    """Without --llama-gguf, llama-server loads the file jaxllm serves by default (the
    same model on both); where --launch names its own --model, the GGUF must be named,
    and the run stops before launching anything."""
    import jaxllm.loaders

    FakeLlamaServer.loaded = []
    monkeypatch.setattr(bench_serving, "LaunchedLlamaServer", FakeLlamaServer)
    monkeypatch.setattr(jaxllm.loaders, "default_model_path", lambda: tmp_path / "default.gguf")
    common = ["--llama-server", "/bin/llama-server", "--dataset", "random", "--num-prompts", "2",
              "--random-input-len", "5", "--random-output-len", "4", "--out", str(tmp_path / "s")]
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", *common])
    bench_serving.main()
    assert FakeLlamaServer.loaded == [str(tmp_path / "default.gguf")]
    assert FakeServer.launched == ["llama-server", ""]

    FakeServer.launched = []
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--launch", "--model x.gguf", *common])
    with pytest.raises(SystemExit) as e:
        bench_serving.main()
    assert e.value.code == 2 and "--llama-server needs --llama-gguf" in capsys.readouterr().err
    assert FakeServer.launched == [] and len(FakeLlamaServer.loaded) == 1


def test_cpu_seconds_counts_a_child_s_work_under_its_parent():
    """CpuSeconds charges a busy child process to the server's tree, by name and pid, and
    the parent's own work to "server"."""
    import subprocess
    import time

    from bench_serving import CpuSeconds

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(3)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"])
    try:
        with CpuSeconds(parent.pid) as cpu:
            time.sleep(2.5)  # the child has spun and sleeps
    finally:
        parent.kill()
        parent.wait(10)
    children = {k: v for k, v in cpu.result["server"].items() if k != "server"}
    assert len(children) == 1 and next(iter(children)).startswith("python")
    assert 0.55 <= next(iter(children.values())) <= 0.9
    assert cpu.result["server"]["server"] < 0.4
    assert 2.5 <= cpu.result["wall"] < 5
    if Path("/proc/stat").exists():  # and what the host took from the machine's cores meanwhile
        assert 0 <= cpu.result["stolen"] <= cpu.result["wall"] * cpu.result["cores"]


def test_the_cpu_line_says_what_the_host_stole():
    cpu = {"server": {"server": 1.0, "python 7": 30.0}, "client": 1.5, "wall": 20.0}
    assert bench_serving.format_cpu_seconds(cpu) == "CPU s in 20.0 s: python 7 30.0, server 1.0; client 1.5"
    line = bench_serving.format_cpu_seconds(cpu | {"stolen": 8.0, "cores": 2})
    assert line.endswith("; client 1.5; stolen by the host 8.0 (20% of 2 cores)")


def test_a_launched_server_keeps_its_start_up_lines_in_the_log(tmp_path, monkeypatch):
    """What the server printed before ready (its start-up line: the backends its plan
    measured) goes to the log with what follows, and `engine` is that line."""
    monkeypatch.setattr(bench_serving, "wait_for_quiet", lambda: None)  # the suite's other workers keep the CPU busy
    log = tmp_path / "server.log"
    server = bench_serving.LaunchedServer("", log)
    script = ("import time; print('compiling'); print('model m loaded in 1.0 s; linear cpu [measured]'); "
              "print('jaxllm ready in 2.0 s', flush=True); print('after', flush=True); time.sleep(30)")
    server.cmd = [sys.executable, "-c", script]
    with server:
        assert server.engine == "model m loaded in 1.0 s; linear cpu [measured]"
        for _ in range(100):
            if "after" in log.read_text():
                break
            time.sleep(0.05)
    assert log.read_text().splitlines() == ["compiling", "model m loaded in 1.0 s; linear cpu [measured]",
                                            "jaxllm ready in 2.0 s", "after"]


def test_the_kv_sampler_polls_once_a_second_and_stops_with_the_run(monkeypatch):
    """/metrics is read once when the run starts, then every KV_POLL_SECONDS (a poll
    costs the server a render), and the sampler ends as soon as the run does, not at
    its next poll (here a minute away)."""
    import asyncio

    class Client:
        gets = 0

        async def get(self, path):
            Client.gets += 1
            return type("R", (), {"text": 'jaxllm:kv_cache_blocks_used{model_name="m"} 7.0\n'})

    async def run() -> list:
        stop, samples = asyncio.Event(), []
        task = asyncio.create_task(bench_serving.sample_kv(Client(), stop, samples))
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.wait_for(task, 10)
        return samples

    assert bench_serving.KV_POLL_SECONDS == 1.0
    monkeypatch.setattr(bench_serving, "KV_POLL_SECONDS", 60.0)
    samples = asyncio.run(run())
    assert Client.gets == 1 and samples == [{"jaxllm:kv_cache_blocks_used": 7.0}]


def test_a_stopped_server_leaves_no_process_of_its_group(monkeypatch):
    """stop() waits out the server's workers too (a child the server left running is
    killed past the timeout), so the next server does not start beside them."""
    import os
    import subprocess

    monkeypatch.setattr(bench_serving, "wait_for_quiet", lambda: None)
    launched = bench_serving.LaunchedServer("")
    launched.cmd = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); "
                    "print('up', flush=True); time.sleep(60)"]
    launched.proc = launched.launch(stdout=subprocess.PIPE, text=True)
    assert launched.proc.stdout.readline() == "up\n"
    start = time.monotonic()
    launched.stop(timeout=1.0)
    assert time.monotonic() - start < 10
    with pytest.raises(ProcessLookupError):
        os.killpg(launched.proc.pid, 0)


def test_cpu_busy_is_a_share_that_counts_a_spinning_process():
    import os
    import subprocess

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = bench_serving.cpu_busy(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.7 / (os.cpu_count() or 1) <= busy <= 1.0  # at least the spinner's core (most of it)


def test_wait_for_quiet_waits_for_an_idle_reading_and_gives_up_saying_so(monkeypatch, capsys):
    readings = iter([0.9, 0.5, 0.05, 0.9])
    monkeypatch.setattr(bench_serving, "cpu_busy", lambda: next(readings))
    bench_serving.wait_for_quiet(busy_below=0.1, at_most_s=60)
    assert next(readings) == 0.9  # stopped at the first idle reading, the third
    monkeypatch.setattr(bench_serving, "cpu_busy", lambda: 0.9)
    bench_serving.wait_for_quiet(busy_below=0.1, at_most_s=0.0)
    assert "still 90% busy" in capsys.readouterr().out
