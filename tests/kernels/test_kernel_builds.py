"""The C++ kernels' correctness tests under the other x86-64 builds: AVX2 + FMA
(-march=x86-64-v3, the register file of an AVX2-only CPU: 8-lane vectors) and the
SSE2 baseline (-march=x86-64: 4-lane vectors, the code path NEON builds take), each in
a subprocess (the library is loaded once per process). The native build runs the same
tests in the main run."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/kernels/test_cpu_attention.py::test_matches_reference",
    "tests/kernels/test_cpu_attention.py::test_sliding_window_and_soft_cap",
    "tests/kernels/test_cpu_attention.py::test_common_prefix_pass_matches_reference",
    "tests/kernels/test_kv_cache_dtypes.py::test_cpu_and_xla_read_each_format",
    "tests/kernels/test_kv_cache_dtypes.py::test_cpu_common_prefix_pass_reads_each_format",
    "tests/kernels/test_kv_cache_dtypes.py::test_cpu_kernel_widens_every_value_exactly",
    "tests/models/test_linear.py::test_dense_kernel_matches_numpy",
    "tests/models/test_linear.py::test_both_bfloat16_paths_give_the_same_sums",
    "tests/models/test_activation_quantization.py::test_kernel_matches_the_reference",
    "tests/models/test_activation_quantization.py::test_grouped_kernel_matches_the_reference",
    "tests/models/test_linear.py::test_grouped_kernel_matches_ragged_dot",
    "tests/models/test_linear.py::test_a_row_count_leaves_the_padding_rows_zero",
    "tests/models/test_linear.py::test_grouped_kernel_over_quantized_experts",
    "tests/models/test_quant.py::test_the_gguf_int8_container_holds_every_weight_exactly",
    "tests/models/test_linear.py::test_vector_lanes_match_the_build",
    "tests/sample/test_sampler.py::test_argmax_kernel_matches_jnp_argmax",
    "tests/sample/test_sampler.py::test_token_scores_kernel_matches_the_jnp_scores",
    "tests/kernels/test_row_ops.py",
]


# The AVX2 check (~40 s of the ~85 s of all of TESTS on a 4-core machine, 206 s on a
# 2-vCPU Xeon on 2026-11-30, nearly all of it the library's build for that ISA): every
# kernel family once (float32 and int8-family panels, int8 activations, the grouped
# kernel, attention with windows and the shared-prefix pass, widening, argmax, the row ops); slow since
# then (the default run's budget), with every test under both builds.
QUICK = [
    "tests/models/test_linear.py::test_vector_lanes_match_the_build",
    "tests/models/test_linear.py::test_dense_kernel_matches_numpy",
    "tests/models/test_linear.py::test_both_bfloat16_paths_give_the_same_sums",
    "tests/models/test_activation_quantization.py::test_kernel_matches_the_reference",
    "tests/models/test_linear.py::test_grouped_kernel_over_quantized_experts",
    "tests/kernels/test_cpu_attention.py::test_sliding_window_and_soft_cap",
    "tests/kernels/test_cpu_attention.py::test_common_prefix_pass_matches_reference",
    "tests/kernels/test_kv_cache_dtypes.py::test_cpu_kernel_widens_every_value_exactly",
    "tests/sample/test_sampler.py::test_argmax_kernel_matches_jnp_argmax",
    "tests/kernels/test_row_ops.py::test_rms_norm_is_its_definition_bit_for_bit",
    "tests/kernels/test_row_ops.py::test_gated",
]


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU flag (False where there is none)."""
    try:
        return any(line.startswith("flags") and flag in line.split() for line in open("/proc/cpuinfo"))
    except OSError:
        return False


PAIRED = [
    "tests/kernels/test_cpu_attention.py::test_bf16_products_prefill_path",
    "tests/kernels/test_cpu_attention.py::test_bf16_products_decode_path",
    "tests/models/test_linear.py::test_both_bfloat16_paths_give_the_same_sums",
]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 ISA levels")
@pytest.mark.parametrize("march,tests", [
    pytest.param("x86-64-v3", QUICK, id="x86-64-v3", marks=pytest.mark.slow),  # AVX2 + FMA
    pytest.param("x86-64-v3", TESTS, id="x86-64-v3-all", marks=pytest.mark.slow),
    pytest.param("x86-64", TESTS, id="x86-64", marks=pytest.mark.slow),  # SSE2
    # AVX-512 with BF16 and no AMX (a Zen 4 or 5's bfloat16 instructions; gcc 12 has no
    # znver4): the attention's paired paths, which an AMX Xeon's native build skips
    pytest.param("cooperlake", PAIRED, id="cooperlake",
                 marks=[pytest.mark.slow, pytest.mark.skipif(not _cpu_has("avx512_bf16"),
                                                              reason="a Cooper Lake build needs AVX512_BF16 to run")]),
])
def test_kernel_tests_pass_under_the_build(march, tests):
    env = {**os.environ, "JAXLLM_CPU_MARCH": march}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_processes_starting_together_build_the_library_once(tmp_path, monkeypatch):
    """pytest's workers (or a server's processes) that start together wait for one build
    instead of each compiling the library (~45 CPU-seconds each): a lock around the
    build, and the file looked for again under it. Threads stand in for processes (each
    opens the lock file itself, so flock excludes them as it does processes)."""
    import threading
    import time

    from jaxllm.cpu_kernels import build

    builds = []

    def fake_compile(compiler, include_dir, path):
        builds.append(path)
        time.sleep(0.3)
        path.write_bytes(b"library")
        return path

    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "_compile", fake_compile)
    found = []
    threads = [threading.Thread(target=lambda: found.append(build.library_path.__wrapped__())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(found) == 3 and len(set(found)) == 1 and found[0].read_bytes() == b"library"


def test_a_build_deletes_the_least_recently_loaded_beyond_the_bound(tmp_path, monkeypatch):
    """Each source change (and ISA level, compiler, jaxlib) builds a library of its own:
    a build deletes the least recently loaded beyond MAX_LIBRARIES, with their lock
    files; loading one refreshes its time."""
    import time

    from jaxllm.cpu_kernels import build

    monkeypatch.setattr(build, "_cache_root", lambda: tmp_path)
    monkeypatch.setattr(build, "_compile", lambda compiler, include_dir, path: path.write_bytes(b"library"))
    hour = 3600
    old = [tmp_path / f"{build.LIBRARY}-old{i}.so" for i in range(build.MAX_LIBRARIES + 2)]
    for i, path in enumerate(old):  # old0 the least recently used
        path.write_bytes(b"old")
        (tmp_path / f".{path.name}.lock").touch()
        os.utime(path, (time.time() - (100 - i) * hour,) * 2)
    os.utime(old[1], None)  # loaded a moment ago by another process
    new = build.library_path.__wrapped__()
    kept = sorted(p.name for p in tmp_path.glob(f"{build.LIBRARY}-*.so"))
    # the new one, the one just loaded, and the 6 most recent of the rest
    assert kept == sorted([new.name, old[1].name, *(p.name for p in old[4:])])
    assert sorted(p.name for p in tmp_path.glob(".*.lock")) == sorted(f".{name}.lock" for name in kept)

    os.utime(new, (time.time() - 300 * hour,) * 2)
    assert build.library_path.__wrapped__() == new  # loaded, not built again
    assert time.time() - new.stat().st_mtime < 60
