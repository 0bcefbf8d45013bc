"""Compiled step executables kept on disk, so a restart loads them instead of
tracing, lowering and compiling.

JAX's persistent compilation cache is keyed by the lowered program, so a restart
would still trace and lower every bucket (over a second each for a 30-layer model)
before it could hit. This store is keyed by everything that goes into the program
instead, known without tracing: the jax/jaxlib versions, the platform and host CPU,
XLA flags, the jax options that change lowering, the source files a step is traced
from, and what the caller adds (model config, argument shapes and dtypes, bucket).
Entries live in `compilation_cache_dir`/jaxllm-executables: the engine passes its
directory down to the runner (no process-wide setting, so two engines in one process
keep to their own); a runner given none stores nothing. A corrupt or unloadable entry is deleted and
the bucket compiled again.

An executable that JAX's own persistent cache returned (if the user turned it on)
is never stored: jaxlib 0.10 serializes such an executable without its kernels
("Function ... not found" when run after loading); `persistent_cache_hits` tells.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import weakref
from pathlib import Path

import jax

from jaxllm.platform import exclusive_lock, host_cpu, prune_least_recently_used

logger = logging.getLogger(__name__)

SUBDIR = "jaxllm-executables"
_LOWERING_OPTIONS = (  # jax options that change what a function lowers to
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion",
)


# What a step is traced from: these parts of jaxllm (the C++ of custom calls too), and
# pallas_kernels.
_TRACED_SOURCES = ("models", "attention", "cpu_kernels", "sample", "worker", "config.py", "sampling_params.py",
                   "platform.py")
MAX_ENTRIES = 256  # oldest entries beyond this are deleted when one is stored
# One executable deserialized at a time (compiling stays two at a time). A test worker died
# of a segmentation fault in jax 0.11.2's serialize_executable.persistent_load with two
# warm-up threads deserializing at once, and again later with this lock held, one thread
# deserializing alone (CPU, 2026-11-29): the lock does not remove that crash, whose cause
# inside jaxlib is not known; both were the pattern _LOADED below now avoids.
_DESERIALIZING = threading.Lock()
# Executables this process stored or loaded, while a runner holds them (file and devices
# -> Compiled): a second engine of the same configuration in the process (the tests make
# many) shares them instead of deserializing each again. Both crashes above were such
# a second engine deserializing what a live one had loaded.
_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _source_files(path: Path) -> list[Path]:
    """`path` itself (a file), or the sources under it (a package)."""
    return sorted(f for ext in ("*.py", "*.cc", "*.h") for f in path.rglob(ext)) or [path]


@functools.cache
def _source_digest() -> str:
    """sha256 over the sources a step is traced from (the custom calls' C++ included)."""
    import jaxllm

    h = hashlib.sha256()
    root = Path(jaxllm.__file__).parent
    files = [f for name in _TRACED_SOURCES for f in _source_files(root / name)]
    try:
        import pallas_kernels

        files += sorted(Path(pallas_kernels.__file__).parent.rglob("*.py"))
    except ImportError:
        pass
    for path in files:
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def environment_fingerprint() -> str:
    """Everything outside the caller's arguments that a compiled step depends on."""
    import jaxlib

    device = jax.local_devices()[0]
    parts = [
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        device.device_kind,
        host_cpu(),
        os.environ.get("XLA_FLAGS", ""),
        repr([(name, getattr(jax.config, name, None)) for name in _LOWERING_OPTIONS]),
        _source_digest(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def store_directory(cache_dir: Path | None) -> Path | None:
    """Where the store keeps executables under an engine's compilation cache (None:
    no store)."""
    return cache_dir / SUBDIR if cache_dir else None


_hits = threading.local()
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **_) -> None:
    if event == _PERSISTENT_CACHE_HIT:
        _hits.count = getattr(_hits, "count", 0) + 1


@functools.cache
def _listen_for_cache_hits() -> None:
    jax.monitoring.register_event_listener(_on_event)


@contextlib.contextmanager
def persistent_cache_hits():
    """Counts JAX persistent-cache hits of compiles in this thread inside the block:
    `with persistent_cache_hits() as hits: ...; hits()`."""
    _listen_for_cache_hits()
    start = getattr(_hits, "count", 0)
    yield lambda: getattr(_hits, "count", 0) - start


class ExecutableStore:
    """Serialized `jax.stages.Compiled` objects, one file per key. `devices`: the
    devices the executables run on, in the order they were compiled for (default: what
    deserialization picks, all of the process's; a one-device executable in a process
    with several devices needs its device named)."""

    def __init__(self, directory: Path | None, *key_parts: object, devices=None) -> None:
        self.directory = directory
        self.devices = devices
        h = hashlib.sha256(environment_fingerprint().encode())
        for part in key_parts:
            h.update(repr(part).encode())
        self.prefix = h.hexdigest()[:24]

    def _path(self, name: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{self.prefix}-{name}.bin"

    def _key(self, path: Path) -> tuple:
        return str(path), None if self.devices is None else tuple(d.id for d in self.devices)

    def load(self, name: str):
        """The compiled executable stored under `name`, or None."""
        from jax.experimental import serialize_executable

        path = self._path(name)
        if path is None or not path.is_file():
            return None
        key = self._key(path)
        try:
            with _DESERIALIZING:
                compiled = _LOADED.get(key)
                if compiled is None:
                    payload, in_tree, out_tree = pickle.loads(path.read_bytes())
                    compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                         execution_devices=self.devices)
                    _LOADED[key] = compiled
            os.utime(path)  # recently used: pruned last
            return compiled
        except Exception as e:  # a truncated file, or an executable this jaxlib cannot load
            logger.warning("dropping unloadable cached executable %s (%s: %s)", path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None

    def save(self, name: str, compiled) -> None:
        from jax.experimental import serialize_executable

        path = self._path(name)
        if path is None:
            return
        _LOADED[self._key(path)] = compiled  # this process's next engine of the same shapes takes it as it is
        try:
            self._write(path, pickle.dumps(serialize_executable.serialize(compiled)))
        except Exception as e:  # serialization unsupported here, or a read-only cache
            logger.warning("cannot store compiled executable %s (%s: %s)", path, type(e).__name__, e)

    def load_text(self, name: str) -> str | None:
        """A small record kept with the executables (the backend plan), or None."""
        path = self._path(name)
        if path is None or not path.is_file():
            return None
        os.utime(path)
        return path.read_text()

    def save_text(self, name: str, text: str) -> None:
        path = self._path(name)
        if path is None:
            return
        try:
            self._write(path, text.encode())
        except OSError as e:  # a read-only cache
            logger.warning("cannot store %s (%s)", path, e)

    def lock(self, name: str, on_wait=None):
        """A context held while one process makes what `name` stores (the backend plan:
        engines starting together, data-parallel replicas, measure it one after the other
        rather than beside each other; `on_wait` called where this one waits); a store
        without a directory holds none."""
        path = self._path(name)
        return contextlib.nullcontext() if path is None else exclusive_lock(path.with_suffix(".lock"), on_wait)

    def _write(self, path: Path, blob: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # atomic: a concurrent reader sees all or nothing
        self._prune()

    def _prune(self) -> None:
        """Keep the MAX_ENTRIES most recently used; another thread or process (warm-up
        compiles on threads; test workers share the cache) may prune the same files."""
        prune_least_recently_used(self.directory.glob("*.bin"), MAX_ENTRIES, lambda old: old.unlink(missing_ok=True))
