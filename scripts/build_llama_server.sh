#!/usr/bin/env bash
# Build llama.cpp's llama-server (the serving baseline of scripts/bench_serving.py)
# from the llama.cpp sources vendored in the llama-cpp-python sdist on PyPI, so no git
# clone and no model download is needed. Needs cmake and a C++ compiler.
#
#   scripts/build_llama_server.sh [build-dir]      # default build/llamacpp
#   LLAMA_ISA=avx2 scripts/build_llama_server.sh   # AVX2 + FMA only (no AVX-512), for the
#                                                  # AVX2 builds of the benchmarks
#   LLAMA_ISA=avx512 scripts/build_llama_server.sh # AVX-512 without AMX (see below)
#   -> prints the path of the llama-server binary
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python release whose vendored llama.cpp is built
DIR=${1:-build/llamacpp}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
ISA=${LLAMA_ISA:-native}
case "$ISA" in
  native) FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF) ;;
  # AVX-512 (VBMI, VNNI, BF16) without AMX: on an Intel Xeon VM whose /proc/cpuinfo lists
  # AMX, the native build died of SIGILL at its first computation (2026-11-25); this one ran
  avx512) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
                 -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
  *) echo "LLAMA_ISA: native, avx512 or avx2, not $ISA" >&2; exit 2 ;;
esac
# A native build runs only on CPUs with the same instructions (the machine changes
# between sessions): its folder is keyed by this CPU's flags.
CPU_KEY=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-8 || echo any)
BUILD="$SRC/build$([ "$ISA" = native ] && echo "-native-$CPU_KEY" || echo "-$ISA")"
BIN="$BUILD/bin/llama-server"

if [ ! -x "$BIN" ]; then
  if [ ! -d "$SRC" ]; then
    "$PY" -m pip download -q --no-deps --no-binary :all: --dest "$DIR" "llama-cpp-python==$VERSION"
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  fi
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${FLAGS[@]}" -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON >"$DIR/cmake-$ISA.log"
  cmake --build "$BUILD" --target llama-server -j "$(nproc)" >"$DIR/build-$ISA.log"
fi
echo "$BIN"
