#!/usr/bin/env bash
# Scaling of data-parallel training on one machine (docs/distributed.md):
# steps/s of `fastattn train` with 1 process and with N processes at the same
# global batch, and with 1 process on 1 thread (per-core reference).
#   bash scripts/bench_distributed.sh [build/fastattn] [steps] [global batch] [nproc]
# Prints a Markdown table. Run it on a quiet machine: other jobs skew it.
set -euo pipefail
bin="${1:-build/fastattn}"
steps="${2:-200}"
batch="${3:-32}"
nproc="${4:-2}"
cores="$(nproc)"
model=(--task copy --length 32 --vocab 10 --layers 2 --heads 4 --d-model 64 --dropout 0
  --eval-every 0 --eval-batches 1 --log-every "$steps" --steps "$steps" --seed 1)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# rate LOG: the steps/s of the last step line (the mean over the run, after start-up)
rate() { grep -Eo '[0-9.]+ steps/s' "$1" | tail -1 | cut -d' ' -f1; }

run() {  # run NAME ARGS...
  local name="$1"
  shift
  local t0 t1
  t0="$(date +%s.%N)"
  "$bin" "$@" >"$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log" >&2; exit 1; }
  t1="$(date +%s.%N)"
  echo "$(rate "$tmp/$name.log") $(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')"
}

echo "| processes x threads | batch per process | global batch | steps/s | sequences/s | wall s ($steps steps, with start-up) |"
echo "|---|---|---|---|---|---|"
row() {  # row LABEL PER GLOBAL RESULT
  read -r r w <<<"$4"
  printf '| %s | %s | %s | %s | %.0f | %.1f |\n' "$1" "$2" "$3" "$r" "$(awk -v r="$r" -v b="$3" 'BEGIN { print r * b }')" "$w"
}
row "1 x 1" "$((batch / nproc))" "$((batch / nproc))" \
  "$(run one1 --threads 1 train "${model[@]}" --batch $((batch / nproc)))"
row "1 x $cores" "$batch" "$batch" "$(run one --threads "$cores" train "${model[@]}" --batch "$batch")"
row "$nproc x $((cores / nproc > 0 ? cores / nproc : 1))" "$((batch / nproc))" "$batch" \
  "$(run dp train "${model[@]}" --batch $((batch / nproc)) --nproc "$nproc")"
row "$nproc x $((cores / nproc > 0 ? cores / nproc : 1)), no overlap" "$((batch / nproc))" "$batch" \
  "$(run dpn train "${model[@]}" --batch $((batch / nproc)) --nproc "$nproc" --dist-no-overlap)"
