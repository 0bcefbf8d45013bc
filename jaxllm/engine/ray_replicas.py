"""Data-parallel replicas as Ray actors (`--data-parallel-backend ray`): each replica's
engine core runs in an actor on any node of the Ray cluster, behind the interface of
one CoreClient (jaxllm.engine.core_client), so the router (jaxllm.engine.dp_client) is
the same as for replicas in local processes.

The actor runs the engine core process's own loop (jaxllm.engine.core_proc) on a
thread, over a connection made of two queues: the frontend's messages arrive by actor
calls (`put`, in order: a concurrency group of one), and its outputs leave by a call
that waits for the next ones (`take`, in a group of its own). A replica whose actor
dies delivers DEAD, as a replica process that exits does.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from jaxllm.engine import serialization as wire
from jaxllm.engine.core_client import DEAD, host_device_flags
from jaxllm.engine.protocol import EngineCoreReady, EngineCoreStartError

logger = logging.getLogger(__name__)
TAKE_SECONDS = 1.0  # how long one `take` call waits for outputs before it returns none


class QueueConnection:
    """The engine core loop's connection (multiprocessing.connection's methods it uses)
    over an inbox and an outbox; None in the inbox is the end of the pipe."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self._inbox, self._outbox = inbox, outbox
        self._held: bytes | None = None
        self.closed = False

    def poll(self, timeout: float = 0.0) -> bool:
        if self._held is None:
            try:
                self._held = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv_bytes(self) -> bytes:
        data, self._held = (self._held, None) if self._held is not None else (self._inbox.get(), None)
        if data is None:
            raise EOFError
        return data

    def send_bytes(self, data: bytes) -> None:
        self._outbox.put(data)


class ReplicaActor:
    """One replica's engine core, on a thread of the actor's process."""

    def __init__(self, config) -> None:
        from jaxllm.engine.core_proc import run_engine_core

        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        conn = QueueConnection(self._inbox, self._outbox)
        self._thread = threading.Thread(target=run_engine_core, args=(config, conn), name="jaxllm-replica",
                                        daemon=True)
        self._thread.start()

    def pid(self) -> int:
        return os.getpid()

    def put(self, data: bytes | None) -> None:
        self._inbox.put(data)

    def take(self, timeout: float = TAKE_SECONDS) -> list[bytes]:
        """The core's next messages (waits up to `timeout` for the first; [] if none)."""
        try:
            out = [self._outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out


class RayCoreClient:
    """CoreClient's interface over a ReplicaActor placed by Ray."""

    def __init__(self, config, name: str, devices: int) -> None:
        import ray

        from jaxllm.engine.ray_executor import connect, worker_env

        connect(ray)
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        env = worker_env(gpus)
        if not gpus:  # its simulated CPU devices
            env["XLA_FLAGS"] = host_device_flags(devices)
        actor = ray.remote(concurrency_groups={"inbox": 1, "outbox": 1})(ReplicaActor)
        self._ray = ray
        self.actor = actor.options(name=name, num_cpus=1, num_gpus=devices if gpus else 0,
                                   scheduling_strategy="SPREAD", runtime_env={"env_vars": env}).remote(config)
        self._pid = None
        self._pending: collections.deque[bytes] = collections.deque()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._dead = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def num_replicas(self) -> int:
        return 1

    def is_alive(self) -> bool:
        return not self._dead.is_set()

    def _take(self) -> list[bytes]:
        return self._ray.get(self.actor.take.options(concurrency_group="outbox").remote())

    def wait_ready(self) -> EngineCoreReady:
        """Block until the replica has loaded and compiled the model."""
        try:
            self._pid = self._ray.get(self.actor.pid.remote())
            while not self._pending:
                self._pending.extend(self._take())
        except self._ray.exceptions.RayError as e:
            self._dead.set()
            raise EngineCoreStartError(f"data-parallel replica actor died during start-up: {e}") from None
        kind, payload = wire.decode(self._pending.popleft())
        if kind != wire.READY:
            raise EngineCoreStartError(f"engine core failed during start-up:\n{payload}")
        return payload

    def start(self, on_message: Callable[[str, Any], None]) -> None:
        reader = threading.Thread(target=self._read, args=(on_message,), name="jaxllm-replica-reader", daemon=True)
        sender = threading.Thread(target=self._write, name="jaxllm-replica-sender", daemon=True)
        self._threads = [reader, sender]
        for thread in self._threads:
            thread.start()

    def _read(self, on_message: Callable[[str, Any], None]) -> None:
        while True:
            while self._pending:
                kind, payload = wire.decode(self._pending.popleft())
                on_message(kind, payload)
                if kind == wire.FATAL:
                    self._dead.set()
                    on_message(DEAD, payload)
                    return
            try:
                self._pending.extend(self._take())
            except self._ray.exceptions.RayError as e:
                if not self._dead.is_set():
                    self._dead.set()
                    logger.error("data-parallel replica actor %s ended: %s", self.actor, type(e).__name__)
                    on_message(DEAD, None)
                return

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.actor.put.options(concurrency_group="inbox").remote(data)
            except self._ray.exceptions.RayError:
                return

    def send(self, kind: str, payload: Any = None) -> None:
        self._outbox.put(wire.encode(kind, payload))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the replica to stop, then end its actor (idempotent)."""
        if self._dead.is_set():
            return
        self._dead.set()
        self.send(wire.SHUTDOWN)
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout)
        self._ray.kill(self.actor)
