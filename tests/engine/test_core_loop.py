"""The engine core process's loop (jaxllm.engine.core_proc): what it sends the frontend
while a step compiles a shape at first use."""

import time
from multiprocessing import Pipe

from jaxllm.engine import core_proc
from jaxllm.engine import serialization as wire


def test_a_compile_at_first_use_sends_heartbeats_until_it_ends(monkeypatch):
    """The frontend takes a busy core's silence for `--engine-hang-timeout` as a hang
    (AsyncLLM.is_healthy); a compile at first use (EngineCore.watch_compiles) is not one,
    so the loop sends a bare heartbeat as it starts and every quarter of HEARTBEAT_SECONDS
    while it runs, and nothing once it has ended."""
    monkeypatch.setattr(core_proc, "HEARTBEAT_SECONDS", 0.4)  # a beat every 0.1 s
    frontend, core_end = Pipe()
    loop = core_proc.EngineCoreLoop(core=None, conn=core_end)
    with loop.compiling():
        time.sleep(0.55)
    received = []
    while frontend.poll(0.3):
        received.append(wire.decode(frontend.recv_bytes()))
    assert 5 <= len(received) <= 7  # at 0, 0.1, ..., 0.5 s
    for kind, outputs in received:
        assert kind == wire.OUTPUTS and outputs.outputs == [] and outputs.stats is None
    assert not frontend.poll(0.3)
