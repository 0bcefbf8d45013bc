"""What the JAX platform is and what follows from it: the activations' dtype, the
backends that can run, and where compiled executables are kept (the weights' dtype
`auto`: jaxllm.loaders.dtype)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

DEFAULT_COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxllm" / "xla"


def backend_candidates(option: str, name: str, choices: Sequence[str], preference: Sequence[str],
                       unavailable: Callable[[str], str | None], logger: logging.Logger) -> list[str]:
    """The backends `name` may mean, for every kind of backend (attention, linear): an
    unknown name or an explicit choice that cannot work here raises ValueError saying
    why, an explicit one that can is the only candidate; `auto` gives those of
    `preference` (this platform's order) that are available, logging why it passed over
    the others. The runner measures the candidates where there are several
    (jaxllm.worker.autotune).

    Args:
        option: the option's name, for messages (``attention_backend``).
        name: what the user asked for.
        choices: the valid names, ``auto`` included.
        preference: the order ``auto`` tries on this platform.
        unavailable: why a backend cannot run here, or None when it can.
        logger: where ``auto``'s choice is explained.
    """
    if name not in choices:
        raise ValueError(f"{option}: unknown {name!r}; choose one of {', '.join(choices)}")
    if name != "auto":
        reason = unavailable(name)
        if reason:
            raise ValueError(f"{option} {name!r}: {reason}")
        return [name]
    available = []
    for candidate in preference:
        reason = unavailable(candidate)
        if reason is None:
            available.append(candidate)
        else:
            logger.warning("%s auto: not %s: %s", option, candidate, reason)
    if not available:
        raise ValueError(f"{option}: no backend can run here")
    return available


def activation_dtype(param_dtype) -> jnp.dtype:
    """The dtype of a step's hidden states and KV cache for weights of `param_dtype`:
    float32 on the CPU platform whatever the weights are, the weights' dtype elsewhere.

    XLA:CPU runs bfloat16 arithmetic outside its dots by converting each operation to
    float32 and back, so a step all in bfloat16 is slower than float32, while bfloat16
    weights with float32 activations (each projection's input rounded to bfloat16 and
    accumulated in float32) are faster (docs/bench-log/2026-11-24..27-evaluation.md). The
    cpu attention kernel then runs as for a float32 model. A step lowered for a GPU on
    a CPU (under an abstract mesh of GPUs: `targets_gpu`) is the GPU's."""
    if jax.default_backend() == "cpu" and not targets_gpu():
        return jnp.dtype(jnp.float32)
    return jnp.dtype(param_dtype)


def compilation_cache_path(cache_dir: str | Path | None = None) -> Path:
    """The directory (created) an engine keeps its compiled step executables and
    converted models in: `cache_dir`, default ~/.cache/jaxllm/xla; the engine passes it
    down (jaxllm.worker.executable_cache), so a restart loads them instead of compiling,
    and two engines in one process keep to their own.

    JAX's own persistent compilation cache is left alone (off unless the user turns it
    on): it is keyed by the lowered program, so a restart would still trace and lower
    every bucket, and an executable it returns cannot be serialized again (jaxlib
    0.10 loses its kernels; the store refuses such executables)."""
    path = Path(cache_dir) if cache_dir else DEFAULT_COMPILATION_CACHE
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def host_cpu() -> str:
    """The host CPU's model and feature flags (XLA:CPU and the C++ kernels compile for
    the host, so what they build is only reused on the same kind of CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in lines:
        if ":" in line:
            key, value = (s.strip() for s in line.split(":", 1))
            fields.setdefault(key, value)
    return f"{fields.get('model name', '')}|{fields.get('flags', fields.get('Features', ''))}"


def busy_cpu_seconds(cpus: Collection[int] | None = None) -> float | None:
    """The busy CPU seconds so far of the cores `cpus` (None: every core), from /proc/stat
    (all but idle and iowait); None where there is no /proc/stat."""
    return _stat_seconds(busy_ticks, cpus)


def stolen_cpu_seconds() -> float | None:
    """The CPU seconds so far that a hypervisor ran something else while this machine's
    cores had work (/proc/stat's steal, every core); None where there is no /proc/stat."""
    return _stat_seconds(steal_ticks, None)


def _stat_seconds(ticks, cpus: Collection[int] | None) -> float | None:
    try:
        with open("/proc/stat") as f:
            return ticks(f.read(), cpus) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _stat_rows(stat: str, cpus: Collection[int] | None) -> list[list[int]]:
    """/proc/stat's tick columns (user nice system idle iowait irq softirq steal ...) of the
    cores `cpus` (their `cpuN` lines), or of every core (the first line, their sum)."""
    rows = [line.split() for line in stat.splitlines() if line.startswith("cpu")]
    rows = rows[:1] if cpus is None else [row for row in rows[1:] if int(row[0][3:]) in cpus]
    return [[int(v) for v in row[1:]] for row in rows]


def busy_ticks(stat: str, cpus: Collection[int] | None = None) -> int:
    """The busy ticks in /proc/stat's text `stat` of the cores `cpus` (its `cpuN` lines),
    or of every core (its first line, `cpu`, their sum) where `cpus` is None."""
    return sum(sum(ticks) - ticks[3] - ticks[4] for ticks in _stat_rows(stat, cpus))


def steal_ticks(stat: str, cpus: Collection[int] | None = None) -> int:
    """The stolen ticks (the eighth column) in /proc/stat's text `stat`, as busy_ticks reads
    its rows; 0 where a kernel's lines are too short to have the column."""
    return sum(ticks[7] if len(ticks) > 7 else 0 for ticks in _stat_rows(stat, cpus))


def usable_cpus() -> frozenset[int] | None:
    """The cores this process may run on (its affinity: `taskset`, a container's cpuset),
    None where that is every core online, or where the OS does not say."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return None if len(cpus) >= (os.cpu_count() or 0) else cpus


@contextlib.contextmanager
def exclusive_lock(path: Path, on_wait: Callable[[], object] | None = None):
    """Held while inside: an exclusive lock on the file `path` (made if missing), which
    other processes wait for (`on_wait` is called first when this one has to); none where
    the platform has no fcntl or `path` cannot be opened for writing (a read-only cache:
    each process then goes on alone)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "a")
    except (ImportError, OSError):
        file = None
    if file is None:  # (the body runs outside the handler: its errors are not chained to this one)
        yield
        return
    with file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        yield


# What an engine enters around each compile at first use (EngineCore.watch_compiles; the
# runners' `while_compiling`, contextlib.nullcontext unless watched).
CompileHook = Callable[[], contextlib.AbstractContextManager]


def prune_least_recently_used(entries, keep: int, remove: Callable[[Path], object], spare_seconds: float = 0.0) -> None:
    """`remove` all but the `keep` most recently used of the cache `entries` (paths; by
    modification time, which a use refreshes), sparing those used in the last
    `spare_seconds` (another process may be reading them). Another thread or process
    may prune the same entries meanwhile."""
    stamped = []
    for path in entries:
        try:
            stamped.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # pruned by someone else meanwhile
            continue
    recent = time.time() - spare_seconds
    for mtime, old in sorted(stamped)[:max(0, len(stamped) - keep)]:
        if mtime < recent:
            remove(old)


# Compute capability 9.x: wgmma is Hopper's (Blackwell multiplies by tcgen05 instead).
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def _abstract_gpu():
    """The GPU an abstract mesh of GPUs in context names (lowering for CUDA on a machine
    without one: pallas_kernels.cuda_lowering.cuda_target), else None."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device if device is not None and device.platform == "gpu" else None


def targets_gpu() -> bool:
    """Whether what is traced now compiles for a GPU: this platform's, or an abstract
    mesh's (the Pallas kernels run in an interpreter otherwise)."""
    return _abstract_gpu() is not None or jax.default_backend() == "gpu"


def targets_hopper() -> bool:
    """Whether the GPU compiled for is a Hopper (compute capability 9.x): the device's,
    or the abstract mesh's device kind."""
    device = _abstract_gpu()
    if device is not None:
        return any(kind in device.device_kind for kind in HOPPER_KINDS)
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "0")).startswith("9.")
