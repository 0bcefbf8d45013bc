#!/usr/bin/env bash
# Wheels of what jaxllm needs beyond a CUDA image that already holds JAX, flax, orbax,
# transformers, tokenizers, safetensors, jaxtyping and pytest (the device machines'
# image: no package index is reachable there), for Python 3.12 on x86-64, into .whl/
# (git-ignored through .git/info/exclude). Versions are this checkout's .venv's. Then,
# on the GPU machine (carry .whl):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 scripts/gpu_check.py --deadline 480 --out gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 any)
for pkg in gguf starlette llguidance pydantic pydantic-core annotated-types typing-inspection uvicorn msgspec beartype; do
  version=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('$pkg'))")
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "$pkg==$version"
done
du -sh .whl
