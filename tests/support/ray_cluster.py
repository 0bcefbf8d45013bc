"""A local Ray cluster of several "nodes" on this machine (one raylet each:
ray.cluster_utils.Cluster), for the tests of an engine placed by Ray, and the checks run
in a process of their own against it (jax.distributed needs a fresh process)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from tests.support.multidevice import MULTIHOST_PROMPTS, ROOT

NODE_MEMORY = 128 * 2**20  # each node's object store: the steps are small


@contextlib.contextmanager
def local_cluster(num_nodes: int = 2, cpus: int = 2):
    """`num_nodes` Ray nodes (`cpus` CPUs each); yields the cluster's address; stopped
    (every raylet and the actors on them) on exit."""
    from ray.cluster_utils import Cluster

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
    `address`; its output (AssertionError with it if it fails)."""
    env = dict(os.environ, RAY_ADDRESS=address, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # each process's devices come from its placement
    code = f"import tests.support.ray_cluster as m; m.{check}(*{list(args)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{check}{tuple(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout


def greedy_options(**options) -> dict:
    """The small engine the Ray tests compare: greedy tokens of MULTIHOST_PROMPTS."""
    return dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory="4MiB",
                dtype="float32", progress=False, **options)


def engine_tokens(folder: str, pipeline: str, tensor: str, processes: str) -> None:
    """Greedy tokens of MULTIHOST_PROMPTS through LLM over `processes` Ray-placed
    processes, printed as `TOKENS [...]`; the engine closed at exit (no explicit call)."""
    from jaxllm import LLM, SamplingParams

    llm = LLM(folder, **greedy_options(pipeline_parallel_size=int(pipeline), tensor_parallel_size=int(tensor),
                                       distributed_executor_backend="ray", num_processes=int(processes)))
    core = llm.llm_engine.core
    assert len(core.executor.workers) == int(processes) - 1
    outs = llm.generate([{"prompt_token_ids": p} for p in MULTIHOST_PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert core.runner.num_compilations_after_warmup == 0
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)


def tokens_of(output: str) -> list[list[int]]:
    return json.loads(next(ln for ln in output.splitlines() if ln.startswith("TOKENS "))[len("TOKENS "):])
