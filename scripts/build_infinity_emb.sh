#!/usr/bin/env bash
# The embedding server infinity-emb (`infinity-emb[torch,server]` on PyPI) in its own
# venv, serving a local sentence-transformers folder on CPU with torch. Python 3.11: the
# only CPU torch wheel this machine keeps on disk (/opt/wheels) is for 3.11, and the
# torch wheels on PyPI pull in the CUDA libraries; it is installed first, pinned, so the
# rest resolves against it. infinity-emb 0.0.78 wants numpy<2, sentence-transformers<4
# and Python <3.14, which pip resolves from its own metadata.
#
#   scripts/build_infinity_emb.sh [venv-dir]  # default build/infinity-emb
#   -> prints the venv's python; exits 1, saying why, where infinity-emb will not install
#      or import
set -euo pipefail

VERSION=${INFINITY_EMB_VERSION:-0.0.78}
TORCH=${INFINITY_EMB_TORCH:-torch==2.13.0+cpu}
VENV=${1:-build/infinity-emb}
PY=$VENV/bin/python
if ! "$PY" -c "import infinity_emb, torch" >/dev/null 2>&1; then
  BASE=${PYTHON311:-$(command -v python3.11 || echo "$HOME/.pyenv/versions/3.11.7/bin/python3.11")}
  if [ ! -x "$BASE" ]; then
    echo "infinity-emb: no Python 3.11 (set PYTHON311)" >&2; exit 1
  fi
  mkdir -p "$(dirname "$VENV")"
  "$BASE" -m venv "$VENV"
  LOG=$VENV.log
  if ! { "$PY" -m pip install -q --upgrade pip && "$PY" -m pip install -q "$TORCH"; } >"$LOG" 2>&1; then
    echo "infinity-emb: no CPU torch ($TORCH) installs here (see $LOG)" >&2; exit 1
  fi
  if ! "$PY" -m pip install -q "infinity-emb[torch,server]==$VERSION" >>"$LOG" 2>&1; then
    echo "infinity-emb: infinity-emb==$VERSION did not install here (see $LOG)" >&2; exit 1
  fi
  if ! "$PY" -c "import infinity_emb, torch; assert torch.version.cuda is None, torch.__version__" >>"$LOG" 2>&1; then
    echo "infinity-emb: installed but does not import, or its torch is not a CPU build (see $LOG)" >&2; exit 1
  fi
fi
echo "$PY"
