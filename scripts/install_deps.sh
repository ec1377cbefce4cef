#!/usr/bin/env bash
# Installs the Debian packages fastattn needs to build, test and run.
# Idempotent: does nothing when everything is already there.
set -euo pipefail

packages=(
  build-essential cmake make git
  libtorch-dev          # LibTorch 1.13 (CPU); set Torch_DIR for a LibTorch 2.x instead
  libopenblas0-openmp   # optimised BLAS for LibTorch (the OpenMP build; pthread fights OpenMP)
  libgloo-dev           # Gloo headers for c10d data-parallel training (the code is in libtorch_cpu)
  libgtest-dev          # unit tests
  libbenchmark-dev      # micro-benchmarks
  nlohmann-json3-dev    # JSON configs and bench output
  zlib1g-dev            # reads the digits data set (gzip CSV)
  fortunes              # text corpus of the charlm task (/usr/share/games/fortunes, 2.6 MB)
  python3-torch         # Python access (same build as libtorch-dev)
  python3-pytest        # Python tests
  python3-venv          # the pip route's virtual environment (scripts/pip_env.sh)
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

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
updated=0

if [ ${#missing[@]} -gt 0 ]; then
  echo "fastattn: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  updated=1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The digits task's data: scikit-learn's digits.csv.gz (1,797 8x8 images),
# shipped by Debian's python3-sklearn. Installing that package pulls scipy and
# more (~100 MB), so unless it is installed we download its .deb (2 MB) and
# extract only this file to $digits_dir (one of the places the task looks:
# src/experiments/train/lm_tasks.cpp, digits_search_path()).
sklearn_digits=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
digits_dir=/usr/local/share/fastattn/data
if [ ! -f "$sklearn_digits" ] && [ ! -f "$digits_dir/digits.csv.gz" ]; then
  echo "fastattn: extracting digits.csv.gz from Debian's python3-sklearn into $digits_dir"
  [ "$updated" -eq 1 ] || $SUDO apt-get update -qq
  tmp="$(mktemp -d)"
  chmod 777 "$tmp"  # apt downloads as the _apt user
  (cd "$tmp" && apt-get download python3-sklearn >/dev/null)
  dpkg-deb -x "$tmp"/python3-sklearn_*.deb "$tmp/x"
  $SUDO mkdir -p "$digits_dir"
  $SUDO cp "$tmp/x$sklearn_digits" "$digits_dir/digits.csv.gz"
  rm -rf "$tmp"
fi
