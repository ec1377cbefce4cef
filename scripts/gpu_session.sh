#!/usr/bin/env bash
# Everything issue 24 needs from a GPU machine, in one command (docs/cuda.md).
# Run from the repository root on a machine with an NVIDIA GPU and a CUDA
# build of PyTorch (the project's device machines: H100/H200, PyTorch
# 2.11+cu130, nvcc 13.0, 16 cores, no network). Device time is short, so:
#
#   scripts/gpu_session.sh --prepare-build PYTHON      (here, on the CPU machine)
#       builds libfastattn.so and fastattn_tests against the torch of PYTHON,
#       a venv's interpreter holding the device's torch release (e.g.
#       `python3 -m venv /tmp/v && /tmp/v/bin/pip install torch==2.11.0`;
#       nvcc here must be the device's major CUDA version), for sm_90, and
#       packs them into .gpu-prebuilt/ (ignored by git; the device tool
#       carries it: 5 MB);
#   scripts/gpu_session.sh                             (on the GPU machine)
#       unpacks .gpu-prebuilt/ when present (otherwise builds, which needs the
#       build's dependencies there: --prepare-deps carries them), then
#       1. the CUDA backend-comparison tests (tests/cuda/), one process per
#          suite so that a CUDA error poisons one suite only; a suite that dies
#          or reports an illegal access is run again under compute-sanitizer;
#       2. the CUDA opcheck cases of the Python suite (tests/python/test_compile.py);
#       3. the benchmarks: bench/cuda/bench_types.py (every type, forward and
#          forward+backward, peak memory, on the dense-attention engine's route
#          and on fastattn's own kernels, against SDPA flash and SDPA's
#          default backend) until DEADLINE
#          seconds from the start (default 360).
# Logs and results go to $OUT (the device tool's output folder) or build-gpu/out.
set -uo pipefail
cd "$(dirname "$0")/.."
DEPS=.gpu-deps
PREBUILT=.gpu-prebuilt
exclude() {
  local f; f="$(git rev-parse --git-common-dir)/info/exclude"; mkdir -p "$(dirname "$f")"
  grep -qx "/$1/" "$f" 2>/dev/null || echo "/$1/" >>"$f"
}

if [[ "${1:-}" == "--prepare-deps" ]]; then
  # Headers and sources a device machine lacks for building there.
  rm -rf "$DEPS" && mkdir -p "$DEPS/prefix/include" "$DEPS/prefix/share/cmake" "$DEPS/prefix/lib"
  cp -r /usr/include/nlohmann "$DEPS/prefix/include/"
  cp -r /usr/share/cmake/nlohmann_json "$DEPS/prefix/share/cmake/"
  cp -r /usr/src/googletest "$DEPS/googletest"
  cp /usr/include/zlib.h /usr/include/zconf.h "$DEPS/prefix/include/"
  exclude "$DEPS"
  du -sh "$DEPS"
  exit 0
fi

if [[ "${1:-}" == "--prepare-build" ]]; then
  py=${2:?usage: --prepare-build PYTHON (a venv interpreter with the device torch release)}
  set -e
  torch_dir=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path + "/Torch")')
  # The test binary runs at the end of its build (test discovery): it needs
  # the CUDA libraries of the venv's nvidia packages, as torch finds them.
  nvidia=$("$py" -c 'import glob, os, nvidia; print(":".join(sorted(set(os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/lib*.so*")))))')
  export LD_LIBRARY_PATH="$nvidia:${LD_LIBRARY_PATH:-}"
  prep=${PREP_BUILD:-build-gpu-prep}
  cmake -S . -B "$prep" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
    -DFASTATTN_CUDA=ON -DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    -DFASTATTN_BUILD_BENCH=OFF -DFASTATTN_BUILD_CLI=OFF
  cmake --build "$prep" -j "$(nproc)" --target fastattn fastattn_tests
  rm -rf "$PREBUILT" && mkdir -p "$PREBUILT"
  (cd "$prep" && tar -cJf "../$PREBUILT/build.tar.xz" --transform 's,^,build-gpu/,S' \
    libfastattn.so* fastattn_build.json fastattn_tests)
  exclude "$PREBUILT"
  du -sh "$PREBUILT"
  exit 0
fi

START=$(date +%s)
DEADLINE=${DEADLINE:-360}
STEPS=${STEPS:-tests python bench direct profile}
step() { [[ " $STEPS " == *" $1 "* ]]; }
OUT=${OUT:-build-gpu/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_session.log") 2>&1
left() { echo $((DEADLINE - ($(date +%s) - START))); }
nvidia-smi -L || true
PY=${PYTHON:-python3}
TORCH_LIB=$($PY -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
         "cuda", torch.version.cuda, torch.cuda.get_device_name())'

if [[ -f "$PREBUILT/build.tar.xz" ]]; then
  tar -xJf "$PREBUILT/build.tar.xz"
  cat build-gpu/fastattn_build.json
else
  TORCH_CMAKE=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
  PREFIX="$TORCH_CMAKE"
  if [[ -d "$DEPS" ]]; then
    if [[ ! -f "$DEPS/prefix/lib/libgtest.a" ]]; then
      cmake -S "$DEPS/googletest" -B /tmp/gtest-build -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null
      cmake --build /tmp/gtest-build -j "$(nproc)" >/dev/null
      cmake --install /tmp/gtest-build --prefix "$DEPS/prefix" >/dev/null
    fi
    zlib=$(ldconfig -p | awk '/libz\.so\.1 /{print $NF; exit}')
    [[ -n "$zlib" && ! -e "$DEPS/prefix/lib/libz.so" ]] && ln -s "$zlib" "$DEPS/prefix/lib/libz.so"
    PREFIX="$PREFIX;$(pwd)/$DEPS/prefix"
  fi
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DFASTATTN_CUDA=ON -DFASTATTN_BUILD_BENCH=OFF \
    -DFASTATTN_BUILD_CLI=OFF -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_PREFIX_PATH="$PREFIX" ${CMAKE_ARGS:-}
  cmake --build build-gpu -j "$(nproc)" --target fastattn fastattn_tests || exit 1
fi
export LD_LIBRARY_PATH="$(pwd)/build-gpu:$TORCH_LIB:${LD_LIBRARY_PATH:-}"
export FASTATTN_LIBRARY="$(pwd)/build-gpu/libfastattn.so"

status=0
if step tests; then
echo "== 1. CUDA tests ($(left) s left)"
suites=$(build-gpu/fastattn_tests --gtest_list_tests --gtest_filter='Cuda*' | grep -E '^[A-Za-z0-9_]+\.$' | tr -d '.')
sanitized=0
for suite in $suites; do
  if (( $(left) < 30 )); then echo "$suite: skipped (time)"; status=1; continue; fi
  timeout 60 build-gpu/fastattn_tests --gtest_filter="$suite.*" --gtest_brief=1 >"/tmp/$suite.log" 2>&1
  rc=$?
  cat "/tmp/$suite.log" >>"$OUT/cuda_tests.txt"
  echo "$suite: exit $rc"
  if [[ $rc != 0 ]]; then
    status=1
    grep -E 'FAILED|Failure|error|Error' "/tmp/$suite.log" | head -20
    if (( sanitized < 2 )) && { grep -qiE 'illegal|misaligned|launch failure|unspecified|Aborted|Segmentation' "/tmp/$suite.log" || [[ $rc -ge 124 ]]; }; then
      sanitized=$((sanitized + 1))
      first=$(grep -m1 -oE "\[  FAILED  \] $suite\.[A-Za-z0-9_/]+" "/tmp/$suite.log" | awk '{print $NF}')
      [[ -z "$first" ]] && first="$suite.*"
      echo "   compute-sanitizer on $first"
      timeout 60 compute-sanitizer --print-limit 5 build-gpu/fastattn_tests --gtest_filter="$first" \
        >>"$OUT/sanitizer.txt" 2>&1
    fi
  fi
done

fi

if step python; then
echo "== 2. Python: opcheck and modules on CUDA ($(left) s left)"
PYTHONPATH=python timeout 100 $PY -m pytest -q -p no:cacheprovider tests/python/test_compile.py \
  tests/python/test_nn.py -k cuda >"$OUT/pytest_cuda.txt" 2>&1 || status=1
tail -15 "$OUT/pytest_cuda.txt"
fi

if step bench; then
echo "== 3. Benchmarks ($(left) s left)"
PYTHONPATH=python $PY bench/cuda/bench_types.py --library "$FASTATTN_LIBRARY" \
  --jsonl "$OUT/bench_types.jsonl" --deadline "$(left)" ${BENCH_ARGS:-} >/dev/null 2>"$OUT/bench_stderr.txt" || status=1
tail -5 "$OUT/bench_stderr.txt"
python3 - "$OUT/bench_types.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "type" in r:
        print(r["dtype"], r["type"], r.get("route", "-"), r["L"], *(f"{k}={r[k]:.3g}" for k in
              ("fwd_ms", "fwd_bwd_ms", "fwd_peak_mib", "fwd_bwd_peak_mib") if isinstance(r.get(k), float)),
              r.get("error", ""), r.get("skipped", ""))
    elif "child_exit" in r:
        print("group", r["group"], "died:", r["child_exit"])
EOF
fi

if step direct; then
  echo "== 4. The operators called directly, against flash ($(left) s left)"
  timeout 120 $PY bench/cuda/bench_cuda.py --library "$FASTATTN_LIBRARY" --dims 64 \
    --lengths 4096 16384 --clustered-lengths 16384 65536 --json "$OUT/bench_cuda.json" || status=1
fi

if step profile; then
  echo "== 5. Nsight Compute ($(left) s left)"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  timeout 150 "$NCU" --profile-from-start off --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    $PY bench/cuda/profile_kernels.py --library "$FASTATTN_LIBRARY" >"$OUT/ncu.txt" 2>&1 || status=1
  grep -E '^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy' \
    "$OUT/ncu.txt" | head -80
fi
echo "== done in $(( $(date +%s) - START )) s, status $status"
exit $status
