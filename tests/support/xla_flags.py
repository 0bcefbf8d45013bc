"""The XLA flags of the test run, which is compile-bound: its programs are compiled with
LLVM's optimizations off. Most of the default run's seconds are XLA's backend compile of
small programs run a few times each; the measurement is in
docs/bench-log/2026-12-02-zen3-avx2.md ("The default test run, compile-bound").

What that leaves untested: the machine code LLVM's optimizations would make of the
step's XLA-emitted fusions. The C++ kernels (jaxllm/cpu_kernels) are built as users get
them (-O3), HLO optimization and fusion are XLA's as always, the numbers each test
compares are computed under the same flags on both sides, and `make bench` runs as users
do. `JAXLLM_TEST_XLA_OPT=1` runs the tests with XLA's default optimizations."""

from __future__ import annotations

import os

FLAGS = ("--xla_backend_optimization_level=0",)


def set_test_xla_flags() -> None:
    """Add FLAGS to this process's XLA_FLAGS (inherited by the servers and checks the tests
    start; the engine's replicas get them through jaxllm.engine.core_client.host_device_flags),
    unless JAXLLM_TEST_XLA_OPT is set or the user's flags name them already. XLA
    reads them when JAX starts its first backend, so that must not have happened yet."""
    if os.environ.get("JAXLLM_TEST_XLA_OPT"):
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("a JAX backend started before the test run set XLA_FLAGS (tests/conftest.py)")
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in FLAGS if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
