#!/usr/bin/env bash
# Experiment 2 (clustered attention paper, table 1): cross-evaluation. Trains
# masked-copy models with full, clustered, improved-clustered and reformer
# attention, then evaluates each trained model with every type (and exact
# top-k, the oracle of improved-clustered) through `fastattn eval`.
#
#   scripts/experiments/cross_eval.sh            # length 64, 8 clusters, 4 rounds (~1 h on 2 cores)
#   scripts/experiments/cross_eval.sh --quick    # minutes: checks it runs end to end
#   options: --out DIR (default runs/cross_eval[-quick]), --bin PATH (build/fastattn),
#            --threads N (default: nproc)
#
# Trained models are kept (DIR/<type>/); a rerun skips them. Results:
# DIR/cross_eval.json (accuracy per trained x evaluated type) and the table
# DIR/cross_eval.md.
set -euo pipefail
cd "$(dirname "$0")/../.."

quick=0; out=""; bin=build/fastattn; threads="$(nproc)"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --bin) bin="$2"; shift ;;
    --threads) threads="$2"; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "cross_eval.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
if [ "$quick" -eq 1 ]; then
  length=16; clusters=4; rounds=2; steps=100
  model=(--layers 2 --heads 2 --d-model 32 --d-ff 64)
  out="${out:-runs/cross_eval-quick}"
else
  # The copy-heatmap settings at one length (scripts/experiments/copy_heatmap.sh).
  length=64; clusters=8; rounds=4; steps=1500
  model=(--layers 2 --heads 4 --d-model 64 --d-ff 128)
  out="${out:-runs/cross_eval}"
fi
[ -x "$bin" ] || { echo "cross_eval.sh: no program at $bin (build it first)" >&2; exit 1; }
mkdir -p "$out"

names=(full clustered improved-clustered reformer)
declare -A spec=(
  [full]=full
  [clustered]="clustered:clusters=$clusters"
  [improved-clustered]="improved-clustered:clusters=$clusters"
  [reformer]="reformer:rounds=$rounds"
  [exact-topk]="exact-topk:topk=32"
)
for n in "${names[@]}"; do
  if [ -f "$out/$n/model.safetensors" ]; then echo "trained already: $n"; continue; fi
  echo "== train $n (${spec[$n]}, length $length)"
  "$bin" --threads "$threads" train --task copy --length "$length" --vocab 10 \
    --mask-fraction 0.2 --attention "${spec[$n]}" "${model[@]}" --dropout 0 --steps "$steps" \
    --batch 16 --optimizer radam --lr 0.001 --eval-every 0 --eval-batches 8 --seed 0 \
    --checkpoint "$out/$n" --log-every 100 >/dev/null
done
for t in "${names[@]}"; do
  for e in "${names[@]}" exact-topk; do
    echo "eval $t with $e"
    "$bin" --threads "$threads" eval --checkpoint "$out/$t" --attention "${spec[$e]}" \
      --json "$out/eval-$t-$e.json" >/dev/null
  done
done

python3 - "$out" "${names[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
evals = names + ["exact-topk"]
acc = {t: {e: json.load(open(f"{out}/eval-{t}-{e}.json"))["metrics"]["accuracy"] for e in evals}
       for t in names}
json.dump(acc, open(f"{out}/cross_eval.json", "w"), indent=2)
lines = ["| trained \\ evaluated | " + " | ".join(evals) + " |",
         "|---|" + "---:|" * len(evals)]
for t in names:
    lines.append(f"| {t} | " + " | ".join(f"{acc[t][e]:.3f}" for e in evals) + " |")
open(f"{out}/cross_eval.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
