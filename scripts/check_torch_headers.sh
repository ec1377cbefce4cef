#!/usr/bin/env bash
# Compile-checks (syntax only) every C++ source against another LibTorch's
# headers, e.g. a LibTorch 2.x unpacked from a wheel or a libtorch zip:
#   scripts/check_torch_headers.sh /path/to/torch   (the folder holding include/)
set -euo pipefail
root=${1:?usage: $0 TORCH_ROOT (the folder with include/)}
cd "$(dirname "$0")/.."
fail=0
# The CPU kernels at their default level (the others differ only in pragmas),
# the bfloat16 ones at amx's (4);
# the per-level test files set their own.
for f in $(git ls-files 'src/*.cpp' 'tests/cpp/*.cpp' 'bench/*.cpp' 'examples/*.cpp'); do
  level=(-DFASTATTN_ISA_LEVEL=0)
  case "$f" in
    tests/cpp/test_kernel_helpers_*) level=() ;;
    *_bf16.cpp) level=(-DFASTATTN_ISA_LEVEL=4) ;;
  esac
  if ! g++ -std=c++17 -fsyntax-only -fopenmp -DFASTATTN_CPU_ISA_MAX=4 "${level[@]}" -Iinclude -Isrc -Itests/cpp \
      -isystem "$root/include" -isystem "$root/include/torch/csrc/api/include" "$f" 2>/tmp/check_torch_headers.err; then
    echo "FAIL $f"; head -20 /tmp/check_torch_headers.err; fail=1
  fi
done
[ $fail -eq 0 ] && echo "all sources compile against $root"
exit $fail
