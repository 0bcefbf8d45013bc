"""Several hosts (processes) as one engine: `jax.distributed` over all of them, one mesh
over every process's devices; process 0 schedules, and every process runs the same
step.

JAX runs a multi-process program in lockstep: each process must launch every step with
the same inputs. Process 0 (the leader) runs the scheduler, the server and the KV cache
manager as on one host; before each model step it sends the step's SchedulerOutput and
token bitmask to the other processes (followers), which apply them to their own model
runner: the runner's host state is a function of the SchedulerOutputs it has seen, so
every process builds the same inputs and runs the same executable. The messages go over
a TCP connection from each follower to the leader (`coordinator port + 1`), authenticated
with a key derived from the coordinator address; JAX's own collectives carry the
tensors.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

logger = logging.getLogger(__name__)
CONNECT_SECONDS = 300.0  # how long a follower keeps trying to reach the leader


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """jax.distributed over `num_processes` processes (before JAX starts a backend);
    nothing for one process."""
    if num_processes == 1:
        return
    if not coordinator_address or ":" not in coordinator_address:
        raise ValueError("coordinator_address: give host:port of process 0 when num_processes > 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id: {process_id} is not in 0..{num_processes - 1}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)


def _endpoint(coordinator_address: str) -> tuple[tuple[str, int], bytes]:
    host, port = coordinator_address.rsplit(":", 1)
    return (host, int(port) + 1), hashlib.sha256(f"jaxllm-steps|{coordinator_address}".encode()).digest()


class StepSender:
    """The leader's side: accepts the followers (in the background), then sends each
    step to all of them."""

    def __init__(self, coordinator_address: str, num_followers: int) -> None:
        address, key = _endpoint(coordinator_address)
        self._listener = Listener(address, authkey=key)
        self._conns: list[Connection] = []
        self._ready = threading.Event()
        self._num_followers = num_followers
        threading.Thread(target=self._accept, name="jaxllm-step-sender", daemon=True).start()

    def _accept(self) -> None:
        while len(self._conns) < self._num_followers:
            self._conns.append(self._listener.accept())
        self._ready.set()

    def send(self, message) -> None:
        """To every follower (waits for them to connect, the first time)."""
        self._ready.wait()
        for conn in self._conns:
            conn.send(message)

    def close(self) -> None:
        if self._ready.is_set():
            self.send(None)
        self._listener.close()


def follow(core, coordinator_address: str) -> None:
    """A follower's loop: run every step the leader sends on `core`'s model runner,
    until the leader stops (None, or the connection closes)."""
    address, key = _endpoint(coordinator_address)
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            conn = Client(address, authkey=key)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    logger.info("following the leader at %s:%d", *address)
    with conn:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message is None:
                return
            sched, bitmask = message
            core.runner.execute_model(sched, bitmask)
