"""Jaxllm on a local Ray cluster of two nodes on this machine: an engine over two
processes placed by Ray (jaxllm.engine.ray_executor) gives one process's tokens, and a
worker that dies takes the server down loudly and quickly; data-parallel replicas as
Ray actors (jaxllm.engine.ray_replicas) share the requests and answer as one does."""

import re
import signal
import time

import pytest

from jaxllm import LLM, SamplingParams
from tests.support import ray_cluster
from tests.support.multidevice import MULTIHOST_PROMPTS

# each engine of these tests compiles these shapes alone (several processes start at once on 2 cores)
FEW_SHAPES = ("--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-scheduler-steps", "1")


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster.local_cluster(num_nodes=2) as address:
        yield address


@pytest.fixture(scope="module")
def one_process(test_models_dir):
    """Greedy completions of MULTIHOST_PROMPTS by an engine in this process: (token ids, text)."""
    llm = LLM(str(test_models_dir / "llama"), **ray_cluster.greedy_options())
    outs = llm.generate([{"prompt_token_ids": p} for p in MULTIHOST_PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


@pytest.mark.slow  # the server test below covers PP 2 over the nodes by default
@pytest.mark.parametrize("pipeline,tensor", [
    ("2", "1"),
    ("2", "2"),  # TP 2 inside each node's stage
    ("1", "2"),  # TP 2 across the nodes: its all-reduces between processes
])
def test_stages_on_two_nodes_give_one_process_s_tokens(cluster, test_models_dir, one_process, pipeline, tensor):
    """PP 2 with a stage on each node: process 0 here, process 1 a Ray worker,
    jax.distributed's coordinator and ids from the placement."""
    out = ray_cluster.run_on_cluster(cluster, "engine_tokens", str(test_models_dir / "llama"), pipeline, tensor, "2")
    assert ray_cluster.tokens_of(out) == [ids for ids, _ in one_process]


@pytest.mark.slow  # two engines with adapters, one over the nodes
def test_adapters_on_two_nodes_give_one_process_s_tokens(cluster, test_models_dir, tmp_path):
    """LoRA over PP 2 with a stage on each node: each process reads the adapters and
    gives them the same slots, a removal included; the tokens of one process."""
    folder = str(test_models_dir / "llama")
    ray_cluster.write_adapters(folder, str(tmp_path))
    llm = LLM(folder, **ray_cluster.greedy_options(enable_lora=True, max_loras=2, max_lora_rank=8))
    want = ray_cluster.adapter_rounds(llm, str(tmp_path))
    out = ray_cluster.run_on_cluster(cluster, "engine_tokens", folder, "2", "1", "2", str(tmp_path))
    assert ray_cluster.tokens_of(out) == want


@pytest.mark.slow  # tests/engine/test_update_weights_processes.py checks the engine's side by default
def test_an_engine_on_two_nodes_takes_weights_from_a_path(cluster, test_models_dir, tmp_path, one_process):
    """update_weights_from_path over PP 2 with a stage on each node: another model's
    weights refused before any process takes them, then each process reads the new ones
    and the tokens are those of one process started from them."""
    import make_test_model

    other = make_test_model.write_model(tmp_path, "llama", seed=7)
    want = ray_cluster.greedy_tokens(LLM(str(other), **ray_cluster.greedy_options()))
    out = ray_cluster.run_on_cluster(cluster, "engine_tokens", str(test_models_dir / "llama"), "2", "1", "2", "",
                                     f"{other},{test_models_dir / 'qwen3'}")
    assert "REFUSED weights: " in out
    assert ray_cluster.tokens_of(out) == [ids for ids, _ in one_process] + want


def test_an_engine_over_two_nodes_serves_and_fails_loudly(cluster, test_models_dir, tmp_path, monkeypatch,
                                                         one_process):
    """The server over two nodes (PP 2, a stage on each): greedy completions give one
    process's texts; then its worker process is killed mid-request: the request ends
    in an error and the server exits within seconds (its orchestrator restarts it),
    nothing hangs."""
    import os

    import httpx
    import openai

    from tests.support.server import Server

    monkeypatch.setenv("RAY_ADDRESS", cluster)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    server = Server(test_models_dir / "llama", tmp_path, "--distributed-executor-backend", "ray",
                    "--num-processes", "2", "--pipeline-parallel-size", "2", "--served-model-name", "tiny",
                    "--dtype", "float32", *FEW_SHAPES, measure=True)  # auto over the nodes: one_process's
    try:
        def complete(ids):
            body = {"model": "tiny", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer test-key"},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert [complete(p) for p in MULTIHOST_PROMPTS] == [text for _, text in one_process]
        pid = int(re.search(r"Ray worker pid (\d+)", server.output()).group(1))
        stream = server.client(timeout=60).completions.create(
            model="tiny", prompt="one two three", max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        next(iter(stream))  # the request runs
        os.kill(pid, signal.SIGKILL)
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for _ in stream:
                pass
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.poll() is not None, "the server is still up 30 s after its worker died"
        assert server.proc.returncode != 0
        assert "process 1 of the engine (a Ray worker) ended" in server.output()
    finally:
        server.stop()


@pytest.mark.slow  # two replica actors to start and compile
def test_replicas_on_the_cluster_serve_as_one(cluster, test_models_dir, tmp_path, monkeypatch):
    """-dp 2 --data-parallel-backend ray: a replica actor on each node, the router as
    for local replicas; concurrent greedy completions equal one engine's offline text,
    both replicas took requests, and each reports its health in /metrics."""
    from tests.engine.test_data_parallel import PROMPTS, offline_texts, replica_metric, served_texts
    from tests.support.server import Server

    monkeypatch.setenv("RAY_ADDRESS", cluster)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    server = Server(test_models_dir / "llama", tmp_path, "-dp", "2", "--data-parallel-backend", "ray",
                    "--served-model-name", "tiny", measure=True)
    try:
        served = served_texts(server, PROMPTS)
        queried = [replica_metric(server, "vllm:prefix_cache_queries_total", i) for i in (0, 1)]
        assert all(q > 0 for q in queried), queried  # both replicas scored prompts
        ages = [replica_metric(server, "jaxllm:seconds_since_report", i) for i in (0, 1)]
        assert all(0 <= a < 5 for a in ages), ages
    finally:
        server.stop()
    assert served == offline_texts(test_models_dir / "llama", PROMPTS)


@pytest.mark.slow  # two engine actors started twice
def test_batch_eval_on_the_cluster_resumes_and_equals_one_process(cluster, test_models_dir, tmp_path):
    """scripts/batch_eval.py --ray-replicas 2 (Ray Data, an engine per actor, one actor
    per node): killed after its first results, then rerun, its results equal the
    single-process run's, in input order; the line the engine rejects is counted in the
    errors file both times."""
    import json
    import os
    import subprocess
    import sys

    import batch_eval

    from tests.scripts.test_batch_eval import read_jsonl, requests, write_jsonl
    from tests.support.multidevice import ROOT

    long_enough = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}  # a chunk of one: ~0.1 s
    lines = [{**line, "sampling_params": long_enough} for line in requests(12)]
    lines.append({"id": "long", "prompt": "Hello world " * 200, "sampling_params": {"max_tokens": 2}})
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    engine = ["--model", str(test_models_dir / "llama"), "--max-model-len", "256", "--kv-cache-memory", "4MiB",
              "--no-progress", *FEW_SHAPES]
    assert batch_eval.main([str(source), str(tmp_path / "one.jsonl"), *engine]) == 1
    ray_out = tmp_path / "ray.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "batch_eval.py"), str(source), str(ray_out), "--ray-replicas", "2",
           "--chunk-size", "1", *engine]
    env = dict(os.environ, RAY_ADDRESS=cluster, JAX_PLATFORMS="cpu")
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while first.poll() is None and time.monotonic() < deadline:
        if ray_out.exists() and ray_out.read_text().count("\n") >= 1:
            first.kill()  # mid-run: some chunks written, others not
            break
        time.sleep(0.01)
    first.wait(60)
    done = ray_out.read_text().count("\n")
    assert 1 <= done < 12, (done, first.stdout.read()[-3000:])
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]  # 1: a malformed line
    assert f"{12 - done} requests in" in second.stdout
    keep = ("id", "text", "prompt_tokens", "completion_tokens", "finish_reason", "stop_reason")
    one = [{k: r[k] for k in keep} for r in read_jsonl(tmp_path / "one.jsonl")]
    assert [{k: r[k] for k in keep} for r in read_jsonl(ray_out)] == one
    errors = read_jsonl(tmp_path / "ray.jsonl.errors.jsonl")
    assert [e["id"] for e in errors] == ["long"] and "maximum context length" in errors[0]["error"]
    assert json.loads((tmp_path / "one.jsonl.errors.jsonl").read_text())["id"] == "long"


@pytest.mark.slow  # an engine actor to start and compile: the serving test covers the engine over the nodes
def test_batch_eval_with_an_engine_on_the_cluster(cluster, test_models_dir, tmp_path, monkeypatch, capsys):
    """scripts/batch_eval.py --ray-replicas 1: the requests through Ray Data to an
    engine actor give the single-process run's results, in input order, and the line the
    engine rejects goes to the errors file."""
    import batch_eval

    from tests.scripts.test_batch_eval import read_jsonl, requests, write_jsonl

    lines = requests(6) + [{"id": "long", "prompt": "Hello world " * 200, "sampling_params": {"max_tokens": 2}}]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    engine = ["--model", str(test_models_dir / "llama"), "--max-model-len", "256", "--kv-cache-memory", "4MiB",
              "--no-progress", *FEW_SHAPES]
    assert batch_eval.main([str(source), str(tmp_path / "one.jsonl"), *engine]) == 1
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    try:
        assert batch_eval.main([str(source), str(tmp_path / "ray.jsonl"), "--ray-replicas", "1", *engine]) == 1
    finally:
        import ray

        ray.shutdown()  # this process's driver: the cluster stays for the other tests
    keep = ("id", "text", "prompt_tokens", "completion_tokens", "finish_reason", "stop_reason")
    one = [{k: r[k] for k in keep} for r in read_jsonl(tmp_path / "one.jsonl")]
    assert [{k: r[k] for k in keep} for r in read_jsonl(tmp_path / "ray.jsonl")] == one
    assert [e["id"] for e in read_jsonl(tmp_path / "ray.jsonl.errors.jsonl")] == ["long"]
    assert "6 requests in" in capsys.readouterr().out
