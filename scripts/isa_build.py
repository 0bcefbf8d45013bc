"""Which instruction set a benchmark runs under, shared by the bench scripts.

`native`: the C++ kernels built with -march=native, XLA and torch free to use what the
CPU has. `avx2`: AVX2 + FMA only, as on an AVX2-only CPU (most AMD EPYC before Zen 4,
many cloud instances): the kernels built with -march=x86-64-v3, XLA's code generation
capped at AVX2, and torch's (the HF baseline) and numpy's OpenBLAS too. On an AVX-512 machine that gives
the register file and vector width of the older one.

What no variable caps: XLA's own dot. jaxlib 0.10.2's matmul library picks its kernels
by CPUID, and neither `--xla_cpu_max_isa=AVX2` (which caps XLA's generated code) nor
`--xla_cpu_use_xnnpack=false`, `--xla_cpu_use_onednn=false` or the YNN/XNN fusion types
change it: on the Intel Xeon (Emerald Rapids) a 2048^3 float32 dot ran at 299-320
GFLOP/s capped and 302 native, above what two cores reach with AVX2 FMAs (the kernels'
AVX2 build: 143-154). So under `avx2` on an AVX-512 machine the all-`xla`
comparison and the MFU denominator are an AVX-512 dot's: stricter than an AVX2-only
CPU would give (on a Zen 4, whose AVX-512 runs at AVX2's width, the difference is small).

The environment must be set before JAX (and torch) start, so `reexec` runs the script
again in a child process with it set.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

ISAS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {
        "JAXLLM_CPU_MARCH": "x86-64-v3",
        "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        # torch's float32 matmul is MKL's sgemm, which neither variable above caps: on an
        # Intel Xeon (AVX-512) 2048^3 ran at 343 GFLOP/s with them and 170 with this one
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "OPENBLAS_CORETYPE": "Haswell",  # numpy's OpenBLAS (DYNAMIC_ARCH): its AVX2 kernels
    },
}


def reexec(isa: str) -> bool:
    """Re-run this script under `isa`'s environment if it is not set yet (exits with the
    child's status). False, with a line saying why, where the build cannot run here."""
    env = ISAS[isa]
    if env and platform.machine() not in ("x86_64", "AMD64"):
        print(f"--isa {isa}: an x86-64 build; this machine is {platform.machine()}, skipped")
        return False
    if any(os.environ.get(key) != value for key, value in env.items()):
        sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, **env}))
    return True


def describe(isa: str) -> str:
    """The CPU, what vector ISA it has, and the build measured: the line every number
    printed by a bench script goes with."""
    model, flags = "?", ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
        flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    has = "AVX-512" if " avx512f" in flags else "AVX2 only" if " avx2" in flags else platform.machine()
    build = "-march=native" if not ISAS[isa] else ", ".join(f"{k}={v}" for k, v in ISAS[isa].items())
    return f"machine: {model} ({has}, {os.cpu_count()} cores); build: {isa} ({build})"
