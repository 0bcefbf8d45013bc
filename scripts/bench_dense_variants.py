#!/usr/bin/env python
"""Variants of the dense kernel's float32 path, alternated in one process, each as a
share of one core's FMA peak (measured between them): for a change to
jaxllm/cpu_kernels/dense.cc whose few percent the shared host's swings (up to 25% between
engine runs minutes apart) would hide in an A/B of whole engine runs.

Each variant (this tree's dense.cc, a file, or dense.cc at a git revision) is built with
the kernels' own flags (jaxllm.cpu_kernels.build: -march=native, or $JAXLLM_CPU_MARCH)
into a library of scripts/dense_variants/harness_lib.cc, which runs the kernel's items
(x packed per tile, then each (row block, panel) item) on one or two threads without XLA;
scripts/dense_variants/harness_main.cc loads them all and runs them in turn, the best of
`--reps` each. The FMA peak loop is AVX2 (x86-64 with FMA); the kernel path is the
narrow or the wide tile, whichever the build's ISA has.

    .venv/bin/python scripts/bench_dense_variants.py --rev HEAD~1          # HEAD~1's against this tree's
    .venv/bin/python scripts/bench_dense_variants.py --file /tmp/dense_variant.cc --threads 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "scripts" / "dense_variants"
KERNELS = ROOT / "jaxllm" / "cpu_kernels"
# SmolLM2-135M's prefill projections (512 rows: q/k/v, the gated MLP's [gate | up], down)
# and a 32-row decode step's [gate | up]
SHAPES = "512,576,960;512,576,3072;512,1536,576;32,576,3072"


def build(source: Path, out: Path) -> None:
    """`source` (a dense.cc) as a harness library at `out`, with the kernels' compiler and flags."""
    import jax

    from jaxllm.cpu_kernels.build import _compiler, flags

    cmd = [_compiler(), *flags(), "-isystem", jax.ffi.include_dir(), f"-I{KERNELS}", f'-DDENSE_CC="{source}"',
           str(HERE / "harness_lib.cc"), "-o", str(out), "-pthread"]
    subprocess.run(cmd, check=True)


def build_driver(out: Path) -> None:
    """harness_main.cc, the driver that loads the libraries, at `out` (the same compiler)."""
    from jaxllm.cpu_kernels.build import _compiler

    subprocess.run([_compiler(), "-O2", str(HERE / "harness_main.cc"), "-o", str(out), "-ldl"], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", action="append", default=[], help="a git revision whose dense.cc is a variant")
    p.add_argument("--file", action="append", default=[], type=Path, help="a dense.cc variant's file")
    p.add_argument("--no-tree", action="store_true", help="leave out this tree's dense.cc")
    p.add_argument("--threads", type=int, choices=(1, 2), default=1)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--shapes", default=SHAPES, help="M,K,N;M,K,N... (N a multiple of 32)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        sources = [] if args.no_tree else [("tree", KERNELS / "dense.cc")]
        for rev in args.rev:
            path = d / f"dense-{len(sources)}.cc"
            path.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:jaxllm/cpu_kernels/dense.cc"],
                                            check=True, capture_output=True).stdout)
            sources.append((rev, path))
        sources += [(str(f), f.resolve()) for f in args.file]
        if not sources:
            sys.exit("no variant to run")
        libs = []
        for i, (name, source) in enumerate(sources):
            print(f"[{i}] {name}", flush=True)
            libs.append(d / f"variant-{i}.so")
            build(source, libs[-1])
        driver = d / "harness"
        build_driver(driver)
        subprocess.run([str(driver), str(args.threads), str(args.reps), args.shapes, *map(str, libs)], check=True)


if __name__ == "__main__":
    main()
