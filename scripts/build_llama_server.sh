#!/usr/bin/env bash
# Build llama.cpp's llama-server (the serving baseline of scripts/bench_serving.py)
# from the llama.cpp sources vendored in the llama-cpp-python sdist on PyPI, so no git
# clone and no model download is needed. Needs cmake and a C++ compiler.
#
#   scripts/build_llama_server.sh [build-dir]      # default build/llamacpp
#   -> prints the path of the llama-server binary
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python release whose vendored llama.cpp is built
DIR=${1:-build/llamacpp}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
BIN="$SRC/build/bin/llama-server"

if [ ! -x "$BIN" ]; then
  if [ ! -d "$SRC" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: --dest "$DIR" "llama-cpp-python==$VERSION"
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  fi
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON >"$DIR/cmake.log"
  cmake --build "$SRC/build" --target llama-server -j "$(nproc)" >"$DIR/build.log"
fi
echo "$BIN"
