#!/usr/bin/env bash
# llama.cpp with its RPC backend (GGML_RPC=ON), for benchmarks/pipeline_vs_llamacpp.py:
# ggml-rpc-server, llama-bench and llama-batched-bench into ~/.cache/llmserve-anchors/bin-rpc/
# (run with LD_LIBRARY_PATH set to that folder). It reuses the tree and build folder of
# the llama-server build (../shared/tools/build_llama_server.sh, run first), in a build
# folder of its own with the same flags and GGML_RPC added.
set -euo pipefail
D=$HOME/.cache/llmserve-anchors
SRC=$(ls -d "$D"/llama_cpp_python-*/vendor/llama.cpp | tail -1)
[ -f "$SRC/build-native/CMakeCache.txt" ] || { echo "run build_llama_server.sh first" >&2; exit 2; }
cd "$SRC"
flags=$(grep -E '^GGML_(AVX|AVX2|FMA|F16C|BMI2|AVX512[A-Z0-9_]*|AVX_VNNI|AMX_[A-Z0-9]+|NATIVE):' \
        build-native/CMakeCache.txt | sed 's/:BOOL=/=/; s/^/-D/')
# shellcheck disable=SC2086
cmake -B build-rpc -G Ninja -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release \
  $flags -DGGML_RPC=ON >/dev/null
cmake --build build-rpc --target ggml-rpc-server llama-bench llama-batched-bench -j"$(nproc)" >/dev/null
mkdir -p "$D/bin-rpc"
cp -a build-rpc/bin/. "$D/bin-rpc/"
echo "$D/bin-rpc/ggml-rpc-server"
