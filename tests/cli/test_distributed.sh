#!/usr/bin/env bash
# Data-parallel training (docs/distributed.md) end to end, on 127.0.0.1:
#  - 2 processes with batch B end with the parameters (and losses) of 1 process
#    with batch 2B, clipping on; resuming keeps them equal; a resume with another
#    world size is refused;
#  - a worker killed (or hung) mid-run makes the survivor exit non-zero with a
#    clear error within --dist-timeout; a rank whose peer never comes fails the
#    rendezvous within it; --nproc reports a killed worker and stops.
# Run by CTest as `distributed_tests`:  bash tests/cli/test_distributed.sh build/fastattn
set -u
bin="$1"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
ok() { echo "ok: $*"; }

# children_of PID: its child processes (from /proc; no procps needed)
children_of() {
  local f
  for f in /proc/[0-9]*/stat; do
    awk -v p="$1" '{ sub(/^.*\) /, ""); if ($2 == p) { split(FILENAME, a, "/"); print a[3] } }' "$f" 2>/dev/null
  done
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# A small model; dropout 0 so one process and two see the same computation.
# RAdam's first steps are un-adapted momentum SGD (updates linear in the
# gradients), so float rounding differences between the two stay at rounding
# level; --lr 0.2 makes the updates large enough that a wrong gradient shows.
# --clip 0.5 is below the gradient norm: clipping must follow the all-reduce.
base=(--task copy --length 8 --vocab 6 --layers 1 --heads 2 --d-model 16 --dropout 0
  --seed 3 --eval-every 0 --eval-batches 1 --log-every 1)
model=("${base[@]}" --lr 0.2 --clip 0.5)

# ---- equivalence: 2 x batch 4 == 1 x batch 8 ---------------------------------
"$bin" --threads 1 train "${model[@]}" --steps 3 --batch 8 --checkpoint "$tmp/one" \
  --metrics "$tmp/one.jsonl" >"$tmp/one.log" 2>&1 || { fail "single process run"; cat "$tmp/one.log"; }
"$bin" --threads 1 train "${model[@]}" --steps 3 --batch 4 --nproc 2 --checkpoint "$tmp/two" \
  --metrics "$tmp/two.jsonl" >"$tmp/two.log" 2>&1 || { fail "--nproc 2 run"; cat "$tmp/two.log"; }
"$bin" --threads 1 train "${model[@]}" --steps 3 --batch 4 --checkpoint "$tmp/half" \
  >"$tmp/half.log" 2>&1 || fail "half-batch run"

compare() {  # compare A B -> "maxdiff scale"
  python3 "$here/compare_safetensors.py" "$1/model.safetensors" "$2/model.safetensors"
}
# the same parameters to float32 rounding
if read -r d s < <(compare "$tmp/one" "$tmp/two") &&
   awk -v d="$d" 'BEGIN { exit !(d < 1e-5) }'; then
  ok "2 processes x batch 4 = 1 process x batch 8 after 3 steps (max |diff| $d)"
else
  fail "2 processes x batch 4 differ from 1 process x batch 8: $(compare "$tmp/one" "$tmp/two" 2>&1)"
  tail -5 "$tmp/two.log"
fi
# ... and the comparison can fail: half the data gives other parameters
if read -r d s < <(compare "$tmp/one" "$tmp/half") &&
   awk -v d="$d" 'BEGIN { exit !(d > 1e-4) }'; then
  ok "1 process x batch 4 differs from batch 8 (max |diff| $d): the check is sensitive"
else
  fail "batch 4 and batch 8 give the same parameters?: $(compare "$tmp/one" "$tmp/half" 2>&1)"
fi
# rank 0's logged loss is the mean over ranks = the combined batch's loss; the
# gradient norm is above --clip (clipping was active)
py_losses='import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "loss" in r and "grad_norm" in r: print(r["step"], r["loss"], r["grad_norm"])'
python3 -c "$py_losses" "$tmp/one.jsonl" >"$tmp/one.loss"
python3 -c "$py_losses" "$tmp/two.jsonl" >"$tmp/two.loss"
if [ "$(wc -l <"$tmp/one.loss")" -eq 3 ] &&
   paste "$tmp/one.loss" "$tmp/two.loss" | awk '{ if ($1 != $4) bad = 1;
     d = $2 - $5; if (d < 0) d = -d; if (d > 1e-5) bad = 1;
     d = $3 - $6; if (d < 0) d = -d; if (d > 1e-4 * $3) bad = 1;
     if ($3 <= 0.5) bad = 1 } END { exit bad }'; then
  ok "losses and gradient norms per step agree (norms above --clip)"
else
  fail "logged losses / grad norms differ"; paste "$tmp/one.loss" "$tmp/two.loss"
fi
# only rank 0 logs: each step line appears once
if [ "$(grep -c '^step 2/3' "$tmp/two.log")" -eq 1 ]; then
  ok "only rank 0 logs"
else
  fail "step lines in --nproc 2 output: $(grep -c '^step 2/3' "$tmp/two.log") (expected 1)"
  cat "$tmp/two.log"
fi

# ---- resume: same world size works and stays equal; another is refused -----------
"$bin" --threads 1 train --checkpoint "$tmp/one" --resume --steps 5 >"$tmp/one5.log" 2>&1 ||
  { fail "single-process resume"; cat "$tmp/one5.log"; }
"$bin" --threads 1 train --checkpoint "$tmp/two" --resume --steps 5 --nproc 2 >"$tmp/two5.log" 2>&1 ||
  { fail "--nproc 2 resume"; cat "$tmp/two5.log"; }
if read -r d s < <(compare "$tmp/one" "$tmp/two") &&
   awk -v d="$d" 'BEGIN { exit !(d < 1e-5) }'; then
  ok "resumed to 5 steps: still equal (max |diff| $d)"
else
  fail "after resume: $(compare "$tmp/one" "$tmp/two" 2>&1)"
fi
out="$("$bin" --threads 1 train --checkpoint "$tmp/two" --resume --steps 6 2>&1)"
rc=$?
if [ "$rc" -eq 1 ] && grep -q "made by 2 process(es) and this run has 1" <<<"$out"; then
  ok "resume with another world size is refused"
else
  fail "resume 2 -> 1 process: exit $rc: $out"
fi

# ---- failures ---------------------------------------------------------------------
long=("${base[@]}" --steps 100000 --batch 4 --dist-timeout 4)
# start_pair LOGPREFIX: two torchrun-style workers in the background
start_pair() {
  local port
  port="$(free_port)"
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$bin" --threads 1 train "${long[@]}" >"$tmp/$1.$r.log" 2>&1 &
    pids+=($!)
    eval "pid$r=$!"
  done
}
# wait_training LOG: until rank 0 logs step 3 (at most 60 s)
wait_training() {
  for _ in $(seq 600); do
    grep -q "^step 3/" "$1" && return 0
    sleep 0.1
  done
  return 1
}
# expect_failure NAME PID LOG PATTERN LIMIT: PID exits non-zero within LIMIT s,
# its output matching PATTERN
expect_failure() {
  local name="$1" pid="$2" log="$3" pattern="$4" limit="$5" start=$SECONDS rc
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -le $((limit + 30)) ]; do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    fail "$name: still running after $((limit + 30)) s"; kill -9 "$pid"; return
  fi
  wait "$pid"
  rc=$?
  local took=$((SECONDS - start))
  if [ "$rc" -ne 0 ] && [ "$took" -le "$limit" ] && grep -Eq -- "$pattern" "$log"; then
    ok "$name: exit $rc after ${took} s: $(grep -Eo -- "$pattern" "$log" | head -1)"
  else
    fail "$name: exit $rc after ${took} s (limit $limit)"; tail -5 "$log"
  fi
}

# A worker killed mid-run: the survivor sees the closed connection.
start_pair killed
if wait_training "$tmp/killed.0.log"; then
  kill -9 "$pid1"
  expect_failure "rank 1 killed" "$pid0" "$tmp/killed.0.log" \
    "distributed: rank 0 of 2: .* failed; another process of the group has probably died" 12
else
  fail "killed: training did not start"; cat "$tmp/killed.0.log" "$tmp/killed.1.log"
fi

# A worker hung (SIGSTOP) mid-run: the survivor gives up after --dist-timeout.
start_pair hung
if wait_training "$tmp/hung.0.log"; then
  kill -STOP "$pid1"
  expect_failure "rank 1 hung" "$pid0" "$tmp/hung.0.log" \
    "distributed: rank 0 of 2: .* failed; another process" 14
  kill -9 "$pid1" 2>/dev/null
else
  fail "hung: training did not start"; cat "$tmp/hung.0.log" "$tmp/hung.1.log"
fi

# A rank whose peers never come: the rendezvous fails within the timeout.
port="$(free_port)"
RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  "$bin" --threads 1 train "${base[@]}" --steps 10 --batch 4 --dist-timeout 2 >"$tmp/alone.log" 2>&1 &
pid=$!
pids+=($pid)
expect_failure "rank 1 without rank 0" "$pid" "$tmp/alone.log" "distributed: rank 1 of 2: rendezvous at 127.0.0.1:$port failed" 10

# --nproc with a worker killed: the launcher names it and exits non-zero.
"$bin" --threads 1 train "${long[@]}" --nproc 2 >"$tmp/launch.log" 2>&1 &
lpid=$!
pids+=($lpid)
if wait_training "$tmp/launch.log"; then
  workers="$(children_of "$lpid")"
  victim="$(tail -1 <<<"$workers")"
  kill -9 "$victim"
  expect_failure "--nproc 2, one worker killed" "$lpid" "$tmp/launch.log" \
    "worker rank [01] \(pid $victim\) was killed by signal 9" 12
  for p in $workers; do
    if kill -0 "$p" 2>/dev/null; then fail "--nproc left worker $p running"; fi
  done
else
  fail "--nproc: training did not start"; cat "$tmp/launch.log"
fi

# Usage: --nproc inside an already distributed launch.
out="$(WORLD_SIZE=2 "$bin" train --nproc 2 --steps 1 2>&1)"
rc=$?
if [ "$rc" -eq 2 ] && grep -q "WORLD_SIZE=2 is already set" <<<"$out"; then
  ok "--nproc with WORLD_SIZE set is a usage error"
else
  fail "--nproc with WORLD_SIZE: exit $rc: $out"
fi
out="$(RANK=0 WORLD_SIZE=2 "$bin" train --steps 1 2>&1)"
rc=$?
if [ "$rc" -eq 1 ] && grep -q "MASTER_ADDR is not" <<<"$out"; then
  ok "WORLD_SIZE without MASTER_ADDR names the variable"
else
  fail "missing MASTER_ADDR: exit $rc: $out"
fi

if [ -n "${SHOW_LOGS:-}" ]; then
  for f in "$tmp"/killed.0.log "$tmp"/hung.0.log "$tmp"/alone.log "$tmp"/launch.log; do
    echo "== $f"; cat "$f"
  done
fi
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
