"""A local Ray cluster of several "nodes" on this machine (one raylet each:
ray.cluster_utils.Cluster), for the tests of an engine placed by Ray, and the checks run
in a process of their own against it (jax.distributed needs a fresh process)."""

from __future__ import annotations

import contextlib
import json
import os

from jaxllm.engine.core_client import host_device_flags
from tests.support.llm import LAZY
from tests.support.multidevice import MULTIHOST_PROMPTS, run_check

NODE_MEMORY = 128 * 2**20  # each node's object store: the steps are small


@contextlib.contextmanager
def local_cluster(num_nodes: int = 2, cpus: int = 2):
    """`num_nodes` Ray nodes (`cpus` CPUs each); yields the cluster's address; stopped
    (every raylet and the actors on them) on exit."""
    from ray.cluster_utils import Cluster

    # Ray's memory monitor kills a worker when the machine is nearly full: here that is the
    # other tests' doing (the default run's parallel workers), not the engine's
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"  # noqa: SIM112 (Ray's own spelling)
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": cpus, "object_store_memory": NODE_MEMORY})
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(num_cpus=cpus, object_store_memory=NODE_MEMORY)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def run_on_cluster(address: str, check: str, *args: str, timeout: float = 600) -> str:
    """`check(*args)` of this module in a new process attached to the cluster at
    `address` (its devices from its placement: no device count in XLA_FLAGS)."""
    flags = host_device_flags(None) or None
    return run_check("tests.support.ray_cluster", check, args, {"RAY_ADDRESS": address, "XLA_FLAGS": flags}, timeout)


def greedy_options(**options) -> dict:
    """The small engine the Ray tests compare: greedy tokens of MULTIHOST_PROMPTS."""
    return dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory="4MiB",
                num_scheduler_steps=1,  # no decode loops to compile: the same tokens
                # the backends `auto` takes over the nodes (the kernel's packed weights are not sharded), given:
                # nothing measured at start-up
                attention_backend="cpu", linear_backend="xla",
                dtype="float32", progress=False, **LAZY | options)


def engine_tokens(folder: str, pipeline: str, tensor: str, processes: str, adapters: str = "", update: str = ""
                  ) -> None:
    """Greedy tokens of MULTIHOST_PROMPTS through LLM over `processes` Ray-placed
    processes, printed as `TOKENS [...]` (with `adapters`, a folder of three LoRA
    adapters: `adapter_rounds`' tokens; with `update`, a folder of the same model's other
    weights: `update_rounds`' tokens); the engine closed at exit (no explicit call)."""
    from jaxllm import LLM

    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8) if adapters else {}
    llm = LLM(folder, **greedy_options(pipeline_parallel_size=int(pipeline), tensor_parallel_size=int(tensor),
                                       distributed_executor_backend="ray", num_processes=int(processes), **options))
    core = llm.llm_engine.core
    assert len(core.executor.workers) == int(processes) - 1
    tokens = adapter_rounds(llm, adapters) if adapters else update_rounds(llm, update) if update else greedy_tokens(llm)
    assert core.runner.num_compilations_after_warmup == 0
    print("TOKENS " + json.dumps(tokens), flush=True)


def greedy_tokens(llm, lora_request=None) -> list[list[int]]:
    from jaxllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in MULTIHOST_PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False,
                        lora_request=lora_request)
    return [o.outputs[0].token_ids for o in outs]


def adapter_rounds(llm, adapters: str) -> list[list[int]]:
    """Two rounds of MULTIHOST_PROMPTS under adapters a1, none, a2, ...; between them a1
    removed and its id given to a3 (the slots every process assigns must agree)."""
    from jaxllm import LoRARequest

    a1, a2, a3 = (LoRARequest(f"a{i}", i, f"{adapters}/a{i}") for i in (1, 2, 3))
    first = greedy_tokens(llm, [a1, None, a2, a1, a2])
    assert llm.remove_lora(1)
    again = LoRARequest("a3", 1, a3.lora_path)
    return first + greedy_tokens(llm, [again, a2, None, again, a2])


def update_rounds(llm, folders: str) -> list[list[int]]:
    """MULTIHOST_PROMPTS before and after the engine takes the weights of the first of
    `folders` ("other,unfitting": update_weights_from_path, every process reading them);
    the second (another model's weights) is refused first, before any process takes it,
    and the engine goes on with what it had."""
    other, unfitting = folders.split(",")
    core = llm.llm_engine.core
    before = greedy_tokens(llm)
    try:
        core.update_weights_from_path(unfitting)
        raise AssertionError("weights of another model were taken")
    except ValueError as e:
        print(f"REFUSED {e}", flush=True)
    assert greedy_tokens(llm) == before
    core.update_weights_from_path(other)
    return before + greedy_tokens(llm)


def write_adapters(model: str, out: str) -> None:
    """Three rank-8 LoRA adapters of `model` in out/a1 .. a3."""
    import sys
    from pathlib import Path

    from tests.support.multidevice import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import make_test_model
    for i in (1, 2, 3):
        make_test_model.write_lora_adapter(Path(model), Path(out) / f"a{i}", rank=8, seed=i, scale=0.1)


def tokens_of(output: str) -> list[list[int]]:
    return json.loads(next(ln for ln in output.splitlines() if ln.startswith("TOKENS "))[len("TOKENS "):])
