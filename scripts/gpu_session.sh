#!/usr/bin/env bash
# Everything issue 10 needs from a GPU machine, in one command (docs/cuda.md).
# Run from the repository root on a machine with an NVIDIA GPU, nvcc and a
# CUDA build of PyTorch (the project's device machines: H100/H200, PyTorch
# 2.11+cu130). Steps:
#   1. the build's dependencies: nlohmann_json, GoogleTest and zlib from
#      .gpu-deps/ (made on a Debian machine by `scripts/gpu_session.sh --prepare`,
#      since the device machine cannot fetch packages) when the system lacks them;
#   2. fastattn built against PyTorch's LibTorch (build-gpu, sm_90);
#   3. the CUDA backend-comparison tests (tests/cuda/) and the emulation tests;
#   4. the GPU benchmarks (bench/cuda/bench_cuda.py).
# Logs and JSON go to $OUT (the device tool's output folder) or build-gpu/out.
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS=.gpu-deps

if [[ "${1:-}" == "--prepare" ]]; then
  # On this (Debian) machine: headers and sources the device machine lacks.
  rm -rf "$DEPS" && mkdir -p "$DEPS/prefix/include" "$DEPS/prefix/share/cmake" "$DEPS/prefix/lib"
  cp -r /usr/include/nlohmann "$DEPS/prefix/include/"
  cp -r /usr/share/cmake/nlohmann_json "$DEPS/prefix/share/cmake/"
  cp -r /usr/src/googletest "$DEPS/googletest"
  cp /usr/include/zlib.h /usr/include/zconf.h "$DEPS/prefix/include/"
  grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >>.git/info/exclude
  du -sh "$DEPS"
  exit 0
fi

OUT=${OUT:-build-gpu/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_session.log") 2>&1
nvidia-smi -L || true
PY=${PYTHON:-python3}
TORCH_CMAKE=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
PREFIX="$TORCH_CMAKE"
if [[ -d "$DEPS" ]]; then
  if [[ ! -f "$DEPS/prefix/lib/libgtest.a" ]]; then
    cmake -S "$DEPS/googletest" -B /tmp/gtest-build -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null
    cmake --build /tmp/gtest-build -j "$(nproc)" >/dev/null
    cmake --install /tmp/gtest-build --prefix "$DEPS/prefix" >/dev/null
  fi
  # zlib: the system's runtime library with the carried headers.
  zlib=$(ldconfig -p | awk '/libz\.so\.1 /{print $NF; exit}')
  [[ -n "$zlib" && ! -e "$DEPS/prefix/lib/libz.so" ]] && ln -s "$zlib" "$DEPS/prefix/lib/libz.so"
  PREFIX="$PREFIX;$(pwd)/$DEPS/prefix"
fi
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFASTATTN_CUDA=ON -DFASTATTN_BUILD_BENCH=OFF \
  -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_PREFIX_PATH="$PREFIX" ${CMAKE_ARGS:-}
cmake --build build-gpu -j "$(nproc)" --target fastattn fastattn_tests fastattn_cuda_emu_tests

status=0
build-gpu/fastattn_tests --gtest_filter='Cuda*' --gtest_output="json:$OUT/cuda_tests.json" || status=1
build-gpu/fastattn_cuda_emu_tests --gtest_brief=1 || status=1
$PY bench/cuda/bench_cuda.py --library build-gpu/libfastattn.so --json "$OUT/bench_cuda.json" \
  ${BENCH_ARGS:-} || status=1
exit $status
