#!/usr/bin/env bash
# The layers of docs/architecture.md ("Map"), lowest first, include only
# headers of their own layer and the layers below:
#   kernels      src/kernels/                 kernels/*
#   operators    src/ops/                     + ops/*, fastattn/ops.h
#   attention    src/attention/, its headers  + attention/*, fastattn/<type>.h
#   transformer  src/transformer/, src/io/    + transformer/*, fastattn/transformer.h, ...
#   experiments  src/experiments/             + experiments/*, fastattn/experiments/*
#   programs     src/cli/                     + cli/*
# The core library (libfastattn) is everything below experiments. Prints each
# include that points upward and exits 1 if there is one.
#   tests/cpp/check_layers.sh SOURCE_DIR
set -euo pipefail
root=${1:?usage: check_layers.sh SOURCE_DIR}
cd "$root"

# Headers of the two layers above attention, as quoted include paths.
transformer_headers='fastattn/(transformer|recurrent_transformer|generation)\.h|transformer/'
upper="$transformer_headers|fastattn/experiments/|experiments/|cli/"

# check LABEL FORBIDDEN_REGEX ALLOWED_REGEX FILES...: every quoted include of
# FILES that matches FORBIDDEN_REGEX and not ALLOWED_REGEX is an upward arrow.
status=0
check() {
  local label=$1 forbidden=$2 allowed=$3
  shift 3
  local hits
  hits=$(grep -HnoE '^#include "[^"]+"' "$@" 2>/dev/null |
         grep -E "#include \"($forbidden)" | grep -vE "#include \"($allowed)\"" || true)
  if [ -n "$hits" ]; then
    echo "check_layers: $label includes a header of a layer above it:"
    echo "$hits" | sed 's/^/  /'
    status=1
  fi
}

mapfile -t kernels < <(find src/kernels -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \))
mapfile -t ops < <(find src/ops -type f \( -name '*.h' -o -name '*.cpp' \))
mapfile -t attention < <(find src/attention -type f \( -name '*.h' -o -name '*.cpp' \))
mapfile -t transformer < <(find src/transformer src/io -type f \( -name '*.h' -o -name '*.cpp' \))
mapfile -t experiments < <(find src/experiments include/fastattn/experiments -type f -name '*.*')
mapfile -t public_core < <(find include/fastattn -maxdepth 1 -name '*.h')
public_attention=()
for h in "${public_core[@]}"; do
  [[ $h =~ /(transformer|recurrent_transformer|generation|fastattn)\.h$ ]] || public_attention+=("$h")
done

none='^$'
check "a kernel" 'fastattn/|ops/|attention/|'"$upper" "$none" "${kernels[@]}"
# fastattn/ops.h is the operators' own public header.
check "an operator" 'fastattn/|attention/|'"$upper" 'fastattn/ops\.h' "${ops[@]}"
check "an attention type" "$upper" "$none" "${attention[@]}" "${public_attention[@]}"
check "the transformer layer" 'fastattn/experiments/|experiments/|cli/' "$none" \
  "${transformer[@]}" "${public_core[@]}"
check "an experiment" 'cli/' "$none" "${experiments[@]}"
if [ "$status" -eq 0 ]; then
  echo "check_layers: ${#kernels[@]} kernel, ${#ops[@]} operator, ${#attention[@]} attention," \
       "${#transformer[@]} transformer, ${#experiments[@]} experiment files: no upward include"
fi
exit "$status"
