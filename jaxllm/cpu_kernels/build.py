"""Building the C++ kernels for XLA:CPU (this directory's .cc files) into one shared library.

Built on first use with the machine's C++ compiler (`$CXX`, else c++ / g++ / clang++)
against the FFI headers of the installed jaxlib, for the host CPU (-march=native; or the
ISA level $JAXLLM_CPU_MARCH names, e.g. x86-64-v3 for AVX2 + FMA), and
kept in `<cache>/jaxllm-kernels/` keyed by the source, the flags, the compiler, jaxlib
and the CPU: a later start loads it at once, and processes starting together (pytest's
workers, a server's) wait on a lock for one build. A build deletes the least recently
loaded beyond MAX_LIBRARIES. No compiler, or a failed build, raises
KernelBuildError with the compiler's message; the `auto` attention and linear backends
then fall back to XLA (jaxllm.attention.backends, jaxllm.models.linear).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DIRECTORY = Path(__file__).parent
# Longest to compile first (_run_all starts them in this order, one a CPU): the attention
# kernels of five KV cache types in two objects, the dense kernels, then two small ones
# (their times: docs/cpu_kernels.md, "Building them").
SOURCES = (DIRECTORY / "paged_attention_more_types.cc", DIRECTORY / "paged_attention.cc", DIRECTORY / "dense.cc",
           DIRECTORY / "argmax.cc", DIRECTORY / "token_scores.cc", DIRECTORY / "row_ops.cc")
HEADERS = (DIRECTORY / "activation.h", DIRECTORY / "amx.h", DIRECTORY / "parallel.h", DIRECTORY / "simd.h")
LIBRARY = "cpu-kernels"
MARCH_ENV = "JAXLLM_CPU_MARCH"  # e.g. x86-64-v3: an AVX2 + FMA build on an AVX-512 machine


def flags() -> tuple[str, ...]:
    """The compiler flags: for the host CPU, or for the ISA level $JAXLLM_CPU_MARCH names
    (to measure and test what an older CPU gets)."""
    march = os.environ.get(MARCH_ENV, "native")
    return ("-O3", f"-march={march}", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")

SUBDIR = "jaxllm-kernels"
# Builds kept per directory (one per source change, ISA level, compiler, jaxlib or CPU):
# when one is built, the least recently loaded beyond these are deleted, but none loaded
# in the last SPARE_SECONDS (a process may be loading it; one loaded stays mapped).
MAX_LIBRARIES = 8
SPARE_SECONDS = 600.0


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built or loaded on this machine."""


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise KernelBuildError("no C++ compiler found (set CXX, or install g++ or clang++)")


def _cache_root() -> Path:
    """The library is one per process (its custom calls are registered once), so it
    lives in the default cache, not in one engine's `compilation_cache_dir`."""
    from jaxllm.platform import DEFAULT_COMPILATION_CACHE

    return DEFAULT_COMPILATION_CACHE / SUBDIR


def _key(compiler: str, include_dir: str) -> str:
    import jaxlib

    from jaxllm.platform import host_cpu

    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{compiler} --version failed: {e}") from e
    h = hashlib.sha256()
    sources = (f.read_bytes() for f in SOURCES + HEADERS)
    for part in (*sources, repr(flags()).encode(), version.encode(), jaxlib.__version__.encode(),
                 include_dir.encode(), host_cpu().encode()):
        h.update(part)
    return h.hexdigest()[:16]


@functools.cache
def library_path() -> Path:
    """The built library, compiling it first if no build for this machine is kept."""
    import jax.ffi

    from jaxllm.platform import exclusive_lock

    compiler = _compiler()
    include_dir = jax.ffi.include_dir()
    name = f"{LIBRARY}-{_key(compiler, include_dir)}.so"
    for root in (_cache_root(), Path(tempfile.gettempdir()) / SUBDIR):
        path = root / name
        if _used(path):
            return path
        lock = root / f".{name}.lock"
        try:
            root.mkdir(parents=True, exist_ok=True)
            open(lock, "a").close()
        except OSError:
            continue  # a read-only cache directory: build in the temp directory instead
        with exclusive_lock(lock):  # processes starting together (a server's, pytest's workers) build it once
            if _used(path):
                return path
            _compile(compiler, include_dir, path)
        _prune(root)
        return path
    raise KernelBuildError(f"no writable directory to build {name} in")


def _used(path: Path) -> bool:
    """Whether the library is built; if so, its time refreshed as a use (for _prune; a
    read-only directory keeps the old time)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except OSError:
        return path.is_file()
    return True


def _prune(root: Path) -> None:
    """Delete the least recently used builds in `root` beyond MAX_LIBRARIES, with their
    lock files."""
    from jaxllm.platform import prune_least_recently_used

    def remove(old: Path) -> None:
        old.unlink(missing_ok=True)
        (root / f".{old.name}.lock").unlink(missing_ok=True)

    prune_least_recently_used(root.glob(f"{LIBRARY}-*.so"), MAX_LIBRARIES, remove, SPARE_SECONDS)


def _compile(compiler: str, include_dir: str, path: Path) -> Path:
    """One object per source, compiled side by side (one process each, up to the CPUs:
    the attention kernel's templates over head dims and KV cache element types take
    most of the time), then linked."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".so")
    os.close(fd)
    objects = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.stem}-objects-")
    compile_flags = [f for f in flags() if f != "-shared"]
    commands = [[compiler, *compile_flags, "-isystem", include_dir, "-c", str(src), "-o", f"{objects}/{src.stem}.o"]
                for src in SOURCES]
    link = [compiler, *flags(), *(cmd[-1] for cmd in commands), "-o", tmp]
    logger.info("building the CPU kernels: %s", " && ".join(" ".join(cmd) for cmd in (*commands, link)))
    try:
        _run_all(commands, parallel=os.cpu_count() or 1)
        _run_all([link], parallel=1)
        os.replace(tmp, path)  # atomic: a concurrent build by another process is equivalent
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building {LIBRARY} failed: {e}") from e
    finally:
        Path(tmp).unlink(missing_ok=True)
        shutil.rmtree(objects, ignore_errors=True)
    return path


def _run_all(commands: list[list[str]], parallel: int) -> None:
    """Run the commands, `parallel` at a time, each started as soon as one before it ends
    (in the given order: longest first keeps the CPUs busy to the end); KernelBuildError
    with the compiler's message if one fails (the others are stopped)."""
    from concurrent.futures import ThreadPoolExecutor

    failures: list[str] = []
    procs: list[subprocess.Popen] = []

    def run(cmd: list[str]) -> None:
        if failures:
            return
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        _, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0 and not failures:
            failures.append(f"{' '.join(cmd)} failed:\n{stderr[-4000:]}")
            for other in procs:
                other.kill()

    with ThreadPoolExecutor(max_workers=max(parallel, 1)) as pool:
        for future in [pool.submit(run, cmd) for cmd in commands]:
            future.result()
    if failures:
        raise KernelBuildError(failures[0])
