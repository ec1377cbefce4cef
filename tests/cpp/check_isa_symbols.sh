#!/usr/bin/env bash
# The CPU kernels' per-level objects (fastattn_cpu_kernels_1 to _4: AVX2,
# AVX-512, AVX512-BF16, AMX) must not export AVX code under a name that other objects also
# define: the linker keeps one copy of a weak symbol (an inline function or
# template instantiation, e.g. std::vector<float>::_M_default_append), and an
# AVX copy would then run on CPUs without AVX (src/kernels/common/isa_target.h).
# Checks every global or weak function of those objects that lies outside the
# level's namespace (fastattn::kernels::isa_avx2 / isa_avx512 / isa_avx512_bf16 / isa_amx) for VEX/EVEX
# instructions (mnemonics starting with 'v') or AMX ones (tile*, tdp*). Exit 1 and the offenders if any.
#   tests/cpp/check_isa_symbols.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: check_isa_symbols.sh BUILD_DIR}
status=0
checked=0
for level in 1 2 3 4; do
  case $level in 1) ns=isa_avx2 ;; 2) ns=isa_avx512 ;; 3) ns=isa_avx512_bf16 ;; 4) ns=isa_amx ;; esac
  dir="$build/CMakeFiles/fastattn_cpu_kernels_$level.dir"
  [ -d "$dir" ] || continue
  while IFS= read -r -d '' obj; do
    checked=$((checked + 1))
    # Global (T) and weak (W) functions outside the level's namespace.
    mapfile -t syms < <(nm --defined-only "$obj" | awk '$2 ~ /^[TW]$/ {print $3}' |
                        while read -r s; do
                          d=$(c++filt "$s")
                          case "$d" in *"::$ns::"*) ;; *) echo "$s" ;; esac
                        done)
    for s in "${syms[@]}"; do
      if objdump -d --no-show-raw-insn "--disassemble=$s" "$obj" |
          awk '/^ +[0-9a-f]+:/ {print $2}' | grep -Eq '^(v|tile|tdp)'; then
        echo "check_isa_symbols: $(basename "$obj") (level $level) exports VEX/AMX code as $(c++filt "$s")"
        status=1
      fi
    done
  done < <(find "$dir" -name '*.o' -print0)
done
if [ "$checked" = 0 ]; then
  echo "check_isa_symbols: no per-level kernel objects under $build" >&2
  exit 1
fi
[ "$status" = 0 ] && echo "check_isa_symbols: $checked objects, no VEX code under shared names"
exit $status
