#!/usr/bin/env bash
# Experiment 1 (clustered attention paper, figure 5): masked-copy accuracy over
# sequence length x clusters for clustered and improved-clustered, over length
# x hashing rounds for reformer, and full attention as the reference.
#
#   scripts/experiments/copy_heatmap.sh            # full scale (hours on 2 cores)
#   scripts/experiments/copy_heatmap.sh --quick    # minutes: checks it runs end to end
#   options: --out DIR (default runs/copy_heatmap[-quick]), --bin PATH (build/fastattn),
#            --threads N (per run; default: nproc), --jobs J (runs at once; default 1:
#            with 2 cores, --threads 1 --jobs 2 finishes soonest), --collect (no
#            training: tables and plot from the runs finished so far)
#
# Each (attention, length) is one `fastattn train --task copy` run with its own
# checkpoint directory under DIR/runs/; a run whose result JSON exists is
# skipped and a run killed half-way resumes from its checkpoint, so the command
# can simply be run again after an interruption. Results: DIR/copy_heatmap.json
# (one record per run), then plot.py makes DIR/copy_heatmap.png and .md.
set -euo pipefail
cd "$(dirname "$0")/../.."

quick=0; out=""; bin=build/fastattn; threads="$(nproc)"; jobs=1; collect=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --bin) bin="$2"; shift ;;
    --threads) threads="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --collect) collect=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "copy_heatmap.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

if [ "$quick" -eq 1 ]; then
  # Two lengths, two settings each, a small model and a few hundred steps.
  lengths=(16 32); clusters=(2 8); rounds=(1 4)
  model=(--layers 2 --heads 2 --d-model 32 --d-ff 64)
  steps=150; long_steps=150; batch=16
  out="${out:-runs/copy_heatmap-quick}"
else
  # Scaled down from the paper (4 layers, 4 heads of 32, lengths up to 511,
  # 15-100 clusters, 1-16 rounds, 8000+ iterations on a GPU) to fit a few
  # hours on 2 CPU cores: sequence (2 * length + 2) of 66 to 514 tokens.
  lengths=(32 64 128 256); clusters=(4 8 16 32); rounds=(1 2 4 8)
  model=(--layers 2 --heads 4 --d-model 64 --d-ff 128)
  # 1,500 steps up to 258 tokens; 3,000 at 514, where full attention itself
  # learns the task only after ~2,300 steps (docs/experiments.md).
  steps=1500; long_steps=3000; batch=16
  out="${out:-runs/copy_heatmap}"
fi
[ "$collect" -eq 1 ] || [ -x "$bin" ] || { echo "copy_heatmap.sh: no program at $bin (build it: cmake --build build --target fastattn_cli)" >&2; exit 1; }
mkdir -p "$out/runs"

# run NAME ATTENTION LENGTH: one training run (skipped when done, resumed when killed).
run() {
  local name="$1" attention="$2" length="$3"
  local dir="$out/runs/$name" result="$out/runs/$name.json"
  if [ -f "$result" ]; then echo "done already: $name"; return; fi
  if [ "$collect" -eq 1 ]; then echo "not run yet: $name"; return; fi
  local resume=() run_steps="$steps"
  [ "$length" -ge 256 ] && run_steps="$long_steps"
  [ -f "$dir/checkpoint.safetensors" ] && resume=(--resume)
  # At most $jobs runs at once (each in the background when jobs > 1).
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  echo "== $name ($attention, length $length, $run_steps steps)"
  if [ "$jobs" -gt 1 ]; then
    train_run "$name" "$attention" "$length" "$run_steps" "${resume[@]}" &
  else
    train_run "$name" "$attention" "$length" "$run_steps" "${resume[@]}"
  fi
}

# train_run NAME ATTENTION LENGTH STEPS [--resume]
train_run() {
  local name="$1" attention="$2" length="$3" run_steps="$4"
  local dir="$out/runs/$name" result="$out/runs/$name.json"
  if [ "${5:-}" = --resume ]; then
    "$bin" --threads "$threads" train --checkpoint "$dir" --resume --result "$result" \
      --log-every 100 >/dev/null
  else
    "$bin" --threads "$threads" train --task copy --length "$length" --vocab 10 \
      --mask-fraction 0.2 --attention "$attention" "${model[@]}" --dropout 0 \
      --steps "$run_steps" --batch "$batch" --optimizer radam --lr 0.001 --eval-every 0 \
      --eval-batches 8 --seed 0 --checkpoint "$dir" --checkpoint-every 250 \
      --metrics "$dir.jsonl" --result "$result" --log-every 100 >/dev/null
  fi
}

start=$(date +%s)
for L in "${lengths[@]}"; do
  run "full-L$L" full "$L"
  for C in "${clusters[@]}"; do
    run "clustered-C$C-L$L" "clustered:clusters=$C" "$L"
    run "improved-clustered-C$C-L$L" "improved-clustered:clusters=$C" "$L"
  done
  for R in "${rounds[@]}"; do
    run "reformer-R$R-L$L" "reformer:rounds=$R" "$L"
  done
done
wait

# One JSON file of all runs.
/usr/bin/python3 - "$out" "$quick" "$(( $(date +%s) - start ))" <<'PY'
import glob, json, os, sys
out, quick, seconds = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
records = []
for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
    r = json.load(open(path))
    att = r["config"]["model"]["attention"]
    att = att if isinstance(att, dict) else {"type": att}
    method = att["type"]
    records.append({
        "run": os.path.basename(path)[:-5],
        "method": method,
        "length": r["config"]["task"]["length"],
        "sequence_length": 2 * r["config"]["task"]["length"] + 2,
        "clusters": att.get("clusters"),
        "rounds": att.get("rounds", 4 if method == "reformer" else None),
        "accuracy": r["eval"]["accuracy"],
        "sequence_accuracy": r["eval"]["sequence_accuracy"],
        "loss": r["eval"]["loss"],
        "steps": r["step"],
        "train_seconds": r["train_seconds"],
        "threads": r["threads"],
    })
json.dump({"experiment": "copy_heatmap", "quick": quick, "driver_seconds": seconds,
           "records": records}, open(os.path.join(out, "copy_heatmap.json"), "w"), indent=2)
print(f"wrote {os.path.join(out, 'copy_heatmap.json')} ({len(records)} runs)")
PY

if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  /usr/bin/python3 scripts/experiments/plot.py copy_heatmap "$out/copy_heatmap.json"
else
  echo "matplotlib missing: run scripts/install_experiment_deps.sh, then" \
       "/usr/bin/python3 scripts/experiments/plot.py copy_heatmap $out/copy_heatmap.json"
fi
