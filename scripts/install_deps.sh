#!/usr/bin/env bash
# Installs the Debian packages fastattn needs to build, test and run.
# Idempotent: does nothing when everything is already there.
set -euo pipefail

packages=(
  build-essential cmake make git
  libtorch-dev          # LibTorch 1.13 (CPU); set Torch_DIR for a LibTorch 2.x instead
  libopenblas0-openmp   # optimised BLAS for LibTorch (the OpenMP build; pthread fights OpenMP)
  libgtest-dev          # unit tests
  libbenchmark-dev      # micro-benchmarks
  nlohmann-json3-dev    # JSON configs and bench output
  python3-torch         # Python access (same build as libtorch-dev)
  python3-pytest        # Python tests
)
# `make fuzz` (scripts/install_deps.sh --fuzz): clang with libFuzzer and its OpenMP.
if [ "${1:-}" = "--fuzz" ]; then
  packages+=(clang-14 libclang-rt-14-dev libomp-14-dev)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "fastattn: installing Debian packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
