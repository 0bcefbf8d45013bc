#!/usr/bin/env bash
# One command on a CUDA machine (after `pip install -e '.[cuda13]'`, or with the image's
# JAX 0.11): the Pallas kernels natively, the engine on them, tensor parallelism over every
# GPU, the benchmarks; one table at the end. Runs on a CPU too (skipping what needs
# CUDA). Arguments go to scripts/gpu_check.py (--out FILE, --only NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PYTHON" scripts/gpu_check.py "$@"
