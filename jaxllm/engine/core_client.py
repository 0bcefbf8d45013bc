"""The frontend's handle on the engine core process: starts it (spawn), sends it
requests and aborts, and delivers what it sends back to a callback.

Sending and receiving each run in a thread of their own, so a long engine step or a
full pipe never blocks the server's event loop. When the process dies (or reports a
fatal error) the callback gets DEAD once.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import re
import threading
from collections.abc import Callable
from typing import Any

from jaxllm.engine import serialization as wire
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.core_proc import run_engine_core
from jaxllm.engine.protocol import EngineCoreReady, EngineCoreStartError

DEAD = "dead"  # delivered to the callback when the core process is gone
_HOST_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def host_device_flags(devices: int | None) -> str:
    """XLA_FLAGS for a core process started to see `devices` CPU devices (a replica's; None:
    as many as its platform gives it): this process's flags with that count in place of any
    they name, so the user's other flags (an ISA cap, an optimization level) reach it too."""
    flags = _HOST_DEVICE_COUNT.sub("", os.environ.get("XLA_FLAGS", "")).split()
    count = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    return " ".join(flags + count)


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """os.environ with `env` set, restored after (for starting a child process)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class CoreClient:
    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None,
                 name: str = "jaxllm-engine-core") -> None:
        """Start the core process; `env`: variables it starts with (set before it
        imports JAX: its devices, for a data-parallel replica)."""
        ctx = mp.get_context("spawn")  # never fork a process that has started JAX threads
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=run_engine_core, args=(config, child_conn), name=name, daemon=True)
        with _environment(env or {}):  # a spawned child starts with the parent's environment
            self.process.start()
        child_conn.close()
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._threads: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def num_replicas(self) -> int:
        """Engine cores that answer a broadcast message (LoRA updates)."""
        return 1

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def wait_ready(self) -> EngineCoreReady:
        """Block until the core has loaded and compiled the model."""
        try:
            kind, payload = wire.decode(self._conn.recv_bytes())
        except EOFError:
            self.process.join(5)
            raise EngineCoreStartError(f"engine core exited during start-up (exit code {self.process.exitcode})") from None
        if kind != wire.READY:
            raise EngineCoreStartError(f"engine core failed during start-up:\n{payload}")
        return payload

    def start(self, on_message: Callable[[str, Any], None]) -> None:
        """Start the reader and sender threads; `on_message(kind, payload)` is called
        from the reader thread."""
        reader = threading.Thread(target=self._read, args=(on_message,), name="jaxllm-core-reader", daemon=True)
        sender = threading.Thread(target=self._write, name="jaxllm-core-sender", daemon=True)
        self._threads = [reader, sender]
        for thread in self._threads:
            thread.start()

    def _read(self, on_message: Callable[[str, Any], None]) -> None:
        while True:
            try:
                kind, payload = wire.decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                on_message(DEAD, None)
                return
            on_message(kind, payload)
            if kind == wire.FATAL:
                on_message(DEAD, payload)
                return

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                return

    def send(self, kind: str, payload: Any = None) -> None:
        self._outbox.put(wire.encode(kind, payload))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, then make sure it has: no orphan process (idempotent)."""
        if self._conn.closed:
            return
        if self.process.is_alive():
            if self._threads:
                self.send(wire.SHUTDOWN)
            else:
                try:
                    self._conn.send_bytes(wire.encode(wire.SHUTDOWN))
                except OSError:
                    pass
        self._outbox.put(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
