"""Data parallelism: `data_parallel_size` engine core processes behind the interface of
one CoreClient (jaxllm.engine.core_client), vLLM's DP engine cores.

Each replica is a whole engine core (its scheduler, KV pool and model runner) in its
own process, started with only its devices visible: tensor x pipeline parallel
consecutive GPUs (CUDA_VISIBLE_DEVICES) or, on a CPU, that many simulated devices; with
`data_parallel_backend` ray, in a Ray actor on any node of the cluster
(jaxllm.engine.ray_replicas). The frontend
routes each request to the least-loaded replica (requests in flight), except that a
prompt whose first KV block was last sent to some replica goes there again while that
replica is not much busier than the least loaded (its prefix is likely cached there);
the `n` samples of one request stay together. Aborts go to the replica that holds the
request; the replicas' scheduler stats are summed for the frontend's gauges and kept
per replica (`EngineCoreOutputs.replica_stats`, `engine` label in /metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxllm.engine import serialization as wire
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.core_client import DEAD, CoreClient, host_device_flags
from jaxllm.engine.protocol import EngineCoreReady
from jaxllm.engine.ray_replicas import RayCoreClient
from jaxllm.messages import SchedulerStats

PREFIX_TOKENS = 16  # the prompt tokens that key prefix affinity (one KV block)
MAX_PREFIXES = 4096  # prefixes remembered (least recently routed dropped first)


def replica_env(replica: int, devices_per_replica: int, data_parallel_size: int) -> dict[str, str]:
    """The environment that gives replica `replica` only its own `devices_per_replica`
    devices (tensor x pipeline parallel)."""
    env = {"XLA_FLAGS": host_device_flags(devices_per_replica)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    needed = data_parallel_size * devices_per_replica
    gpus = visible.split(",") if visible else [str(i) for i in range(needed)]
    if len(gpus) < needed:
        raise ValueError(f"data_parallel_size={data_parallel_size} x {devices_per_replica} devices per replica "
                         f"(tensor x pipeline parallel) needs {needed} devices; CUDA_VISIBLE_DEVICES has {len(gpus)}")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[replica * devices_per_replica:(replica + 1) * devices_per_replica])
    return env


def _replica(config: EngineConfig, index: int) -> CoreClient | RayCoreClient:
    """Replica `index`: a local process with its devices, or (data_parallel_backend ray)
    an actor wherever Ray places it."""
    if config.data_parallel_backend == "ray":
        return RayCoreClient(config, f"jaxllm-replica-{os.getpid()}-{index}", config.devices_per_engine)
    env = replica_env(index, config.devices_per_engine, config.data_parallel_size)
    return CoreClient(config, env=env, name=f"jaxllm-engine-core-{index}")


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' stats as one engine's: counts and totals summed, KV usage the mean
    (the replicas' pools are the same size)."""
    total = SchedulerStats()
    for s in stats:
        for f in dataclasses.fields(SchedulerStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    total.kv_cache_usage /= max(len(stats), 1)
    return total


class DataParallelClient:
    def __init__(self, config: EngineConfig) -> None:
        dp = config.data_parallel_size
        self.clients = [_replica(config, i) for i in range(dp)]
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # core request id -> replica
        self._in_flight = [0] * dp
        self._prefixes: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        self._stats = [SchedulerStats() for _ in range(dp)]
        self._reported = [time.monotonic()] * dp  # when each replica last sent outputs (or its heartbeat)

    # -------------------------------------------------- CoreClient's interface

    @property
    def pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def num_replicas(self) -> int:
        return len(self.clients)

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    def wait_ready(self) -> EngineCoreReady:
        """Every replica loaded and compiled; the first one's description (they are the
        same model, devices and KV pool size)."""
        return [c.wait_ready() for c in self.clients][0]

    def start(self, on_message: Callable[[str, Any], None]) -> None:
        for i, client in enumerate(self.clients):
            client.start(lambda kind, payload, i=i: self._on_message(i, kind, payload, on_message))

    def send(self, kind: str, payload: Any = None) -> None:
        if kind == wire.ADD:
            for replica, requests in self._route(payload).items():
                self.clients[replica].send(wire.ADD, requests)
        elif kind == wire.ABORT:
            with self._lock:
                by_replica: dict[int, list[str]] = collections.defaultdict(list)
                for request_id in payload:
                    if request_id in self._owner:
                        by_replica[self._owner[request_id]].append(request_id)
            for replica, ids in by_replica.items():
                self.clients[replica].send(wire.ABORT, ids)
        else:
            for client in self.clients:
                client.send(kind, payload)

    def shutdown(self, timeout: float = 10.0) -> None:
        for client in self.clients:
            client.shutdown(timeout)

    # ---------------------------------------------------------------- routing

    def _route(self, requests: list) -> dict[int, list]:
        """The replica for `requests` (the samples of one request: kept together)."""
        prompt = tuple(requests[0].prompt_token_ids[:PREFIX_TOKENS])
        with self._lock:
            least = min(range(len(self.clients)), key=lambda i: (self._in_flight[i], self._stats[i].kv_cache_usage))
            replica = self._prefixes.get(prompt) if len(prompt) == PREFIX_TOKENS else None
            slack = max(2, sum(self._in_flight) // (2 * len(self.clients)))
            if replica is None or self._in_flight[replica] - self._in_flight[least] > slack:
                replica = least
            if len(prompt) == PREFIX_TOKENS:
                self._prefixes[prompt] = replica
                self._prefixes.move_to_end(prompt)
                if len(self._prefixes) > MAX_PREFIXES:
                    self._prefixes.popitem(last=False)
            for r in requests:
                self._owner[r.request_id] = replica
            self._in_flight[replica] += len(requests)
        return {replica: requests}

    def _on_message(self, replica: int, kind: str, payload: Any, on_message: Callable[[str, Any], None]) -> None:
        if kind == wire.OUTPUTS:
            with self._lock:
                for output in payload.outputs:
                    if output.finished and self._owner.pop(output.request_id, None) is not None:
                        self._in_flight[replica] -= 1
                self._reported[replica] = time.monotonic()
                if payload.stats is not None:
                    self._stats[replica] = payload.stats
                    ages = [self._reported[replica] - t for t in self._reported]
                    payload = dataclasses.replace(payload, stats=sum_stats(self._stats), replica_stats=list(self._stats),
                                                  replica_report_ages=ages)
                payload.engine_index = replica
        elif kind == wire.REJECTED:
            with self._lock:
                if self._owner.pop(payload.request_id, None) is not None:
                    self._in_flight[replica] -= 1
        elif kind == DEAD and payload is None:
            payload = f"data-parallel replica {replica} exited"
        on_message(kind, payload)
