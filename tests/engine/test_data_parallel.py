"""Data parallelism through the server: `-dp 2 -tp 2` over 4 simulated CPU devices
(each replica an engine core process with 2 of them) gives the tokens one device gives,
and both replicas serve requests (jaxllm.engine.dp_client)."""

import concurrent.futures
import re

import httpx
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.core_client import host_device_flags
from jaxllm.engine.dp_client import replica_env, sum_stats
from jaxllm.messages import SchedulerStats
from tests.support.llm import LAZY
from tests.support.server import Server


def replica_metric(server: Server, name: str, engine: int) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*engine="{engine}"[^}}]*\}} (\S+)$', text, re.M)
    assert m, (name, engine)
    return float(m.group(1))


PROMPTS = [[int(t) for t in range(3 + 7 * i, 23 + 7 * i)] for i in range(8)]


def served_texts(server: Server, prompts: list[list[int]]) -> list[str]:
    """Greedy completions (12 tokens) of `prompts` from a server serving "tiny", 8 at once."""
    def complete(ids):
        body = {"model": "tiny", "prompt": ids, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer test-key"},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(complete, prompts))


def offline_texts(folder, prompts: list[list[int]]) -> list[str]:
    """The same completions from one engine in this process."""
    llm = LLM(str(folder), max_model_len=256, progress=False, **LAZY)
    return [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                    SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)]


@pytest.mark.slow  # two engine core processes to start and compile: ~50 s
def test_dp2_tp2_through_the_server_equals_one_device(test_models_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    server = Server(test_models_dir / "llama", tmp_path, "-dp", "2", "-tp", "2", "--served-model-name", "tiny", measure=True)
    try:
        served = served_texts(server, PROMPTS)
        queried = [replica_metric(server, "vllm:prefix_cache_queries_total", i) for i in (0, 1)]
        assert all(q > 0 for q in queried), queried  # both replicas scored prompts
    finally:
        server.stop()
    assert served == offline_texts(test_models_dir / "llama", PROMPTS)


def test_each_replica_sees_only_its_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = replica_env(1, devices_per_replica=2, data_parallel_size=2)
    assert env == {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2",
                   "CUDA_VISIBLE_DEVICES": "2,3"}
    assert host_device_flags(None) == "--xla_cpu_max_isa=AVX2"  # a Ray node's engine: its devices from its placement
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match="needs 4 devices; CUDA_VISIBLE_DEVICES has 3"):
        replica_env(0, devices_per_replica=2, data_parallel_size=2)


def test_replica_stats_add_up():
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_hits=10)
    b = SchedulerStats(num_running=3, kv_cache_usage=0.25, prefix_cache_hits=5)
    total = sum_stats([a, b])
    assert (total.num_running, total.num_waiting, total.prefix_cache_hits) == (5, 1, 15)
    assert total.kv_cache_usage == pytest.approx(0.375)


def test_offline_llm_refuses_data_parallel(test_models_dir):
    with pytest.raises(ValueError, match="data-parallel replicas are served by"):
        LLM(str(test_models_dir / "llama"), data_parallel_size=2, progress=False)
