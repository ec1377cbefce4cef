#!/usr/bin/env bash
# End-to-end checks of the `fastattn` program: help, exit codes, error
# messages that list what is valid, list, and a tiny bench with --json.
# Run by CTest as `cli_tests`:  bash tests/cli/test_cli.sh build/fastattn
set -u
bin="$1"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
failures=0

# expect CODE PATTERN -- ARGS...: runs the program, checks the exit code and
# that stdout+stderr matches the extended regex PATTERN.
expect() {
  local code="$1" pattern="$2"
  shift 3
  local out rc
  out="$("$bin" "$@" 2>&1)"
  rc=$?
  if [ "$rc" -ne "$code" ]; then
    echo "FAIL: fastattn $* exited $rc, expected $code"; echo "$out" | head -20
    failures=$((failures + 1))
  elif ! grep -Eq -- "$pattern" <<<"$out"; then
    echo "FAIL: fastattn $*: output does not match /$pattern/"; echo "$out" | head -20
    failures=$((failures + 1))
  else
    echo "ok: fastattn $*"
  fi
}

expect 0 "commands:.*" -- --help
expect 0 "bench +time attention types" -- --help
expect 2 "no command given; valid commands: .*list" --
expect 2 "unknown command 'frobnicate'; valid commands: approx, bench, demo, eval, generate, list, train" -- frobnicate
expect 2 "unknown flag '--nope'; valid flags: --json, --threads, --cpu-capability, --version, --help" -- list --nope
# The CPU kernels' instruction set: --version names it; a lower level by flag
# or environment; bad values are errors naming what is valid.
expect 0 "^CPU kernels: (default|avx2|avx512|avx512_bf16|amx) \(this CPU and build: default" -- --version
expect 0 "^CPU kernels: default \(" -- --cpu-capability default --version
expect 0 "CPU kernels: default \(" -- list --cpu-capability=default --version
FASTATTN_CPU_CAPABILITY=default expect 0 "^CPU kernels: default \(" -- --version
expect 2 "--cpu-capability: expected one of default, avx2, avx512, avx512_bf16, amx; got 'sse9'" -- --cpu-capability sse9 list
FASTATTN_CPU_CAPABILITY=bogus expect 1 "FASTATTN_CPU_CAPABILITY: expected one of default, avx2, avx512, avx512_bf16, amx; got 'bogus'" -- --version
expect 2 "--cpu-capability given twice" -- --cpu-capability default list --cpu-capability default
# Debian's LibTorch multiplies with OpenBLAS: --version names its kernels; a
# core without AVX2 kernels on a CPU with AVX2 (an OpenBLAS older than the
# CPU) is replaced by the program (OPENBLAS_CORETYPE), one set by the user is
# left alone.
if "$bin" --version | grep -q "^BLAS: OpenBLAS"; then
  OPENBLAS_CORETYPE=Prescott expect 0 "^BLAS: OpenBLAS, Prescott kernels$" -- --version
  if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    expect 0 "^BLAS: OpenBLAS, (Haswell|Excavator|Zen|SkylakeX|Dhyana|Cooperlake|SapphireRapids) kernels" -- --version
  fi
fi
expect 0 "1 threads, CPU kernels default, median" -- --threads 1 --cpu-capability default bench \
  --attention full --length 48 --repeat 1
expect 2 "--threads must be an integer, got 'many'" -- --threads many list
expect 2 "--threads must be >= 1" -- list --threads=0
expect 2 "given twice" -- bench --length 4 --length 8
expect 2 "--length must be an integer, got 'x'" -- bench --length 4,x
expect 2 "needs a value" -- bench --dtype
expect 2 "--dtype must be float32, float64 or bfloat16, got 'half'" -- bench --dtype half
# bfloat16 through every kind of type: fused (full), composite (linear),
# learned parameters (clusterformer, cast with the module).
expect 0 "clusterformer:clusters=2 +16 +backward" -- bench --attention full,linear,clusterformer:clusters=2 \
  --length 16 --pass both --repeat 1 --heads 2 --dim 8 --dtype bfloat16
expect 2 "--pass must be forward, backward or both" -- bench --pass up
expect 2 "--causal must be true or false" -- bench --causal=maybe
expect 2 "unknown attention type 'nope'" -- bench --attention nope
expect 2 "has no parameter 'foo'; its parameters: softmax_temp" -- bench --attention full:foo=1
expect 2 "softmax_temp of full must be a number, got 'abc'" -- bench --attention full:softmax_temp=abc
expect 2 "softmax_temp" -- bench --attention full:softmax_temp=-1
expect 0 "usage: fastattn bench.*" -- bench --help
expect 0 "TYPE\[:PARAM=VALUE" -- bench -h
expect 0 "softmax_temp +float +\(none\) +> 0" -- list
expect 0 "conditional-full:<type>" -- list
expect 0 "attn_mask: bool; L < S rows; step form; selects \(in float16" -- list
expect 0 '"types"' -- list --json
# conditional-full:local runs full at 16 and local at 48, whose causal window
# of 128 holds every earlier key there: both equal full up to rounding.
expect 0 "full +48 +backward" -- --threads 1 bench \
  --attention full,conditional-full:local:length_limit=32:window=128 \
  --length 16,48 --pass both --causal --repeat 1 --heads 2 --dim 8 --dtype float64 --json "$tmp/b.json"

# The JSON file: 2 specs x 2 lengths x 2 passes = 8 records with the fields.
if [ -f "$tmp/b.json" ] && [ "$(grep -c '"time_ms"' "$tmp/b.json")" -eq 8 ] &&
   grep -q '"peak_memory_bytes"' "$tmp/b.json" && grep -q '"max_abs_error"' "$tmp/b.json"; then
  echo "ok: bench --json wrote 8 records"
else
  echo "FAIL: bench --json records"; cat "$tmp/b.json" 2>/dev/null | head -40
  failures=$((failures + 1))
fi
# float64 errors (full against the reference, conditional-full:local against
# full on both sides of its length limit) must be at rounding level.
if ! grep -o '"max_abs_error": [^,}]*' "$tmp/b.json" |
     awk '{ if ($2 + 0 > 1e-9) bad = 1 } END { exit bad }'; then
  echo "FAIL: a max_abs_error is above 1e-9"; grep '"max_abs_error"' "$tmp/b.json"
  failures=$((failures + 1))
fi

# generate: a tiny model, greedy and sampled; --bench at small positions.
small=(--layers 1 --d-model 16 --heads 2 --vocab 11)
expect 0 "usage: fastattn generate" -- generate --help
expect 0 "generated: ([0-9]+,){4}[0-9]+$" -- --threads 1 generate "${small[@]}" --prefix 1,2,3 \
  --max-new-tokens 5 --greedy
expect 0 "generated: ([0-9]+,){5}[0-9]+$" -- --threads 1 generate "${small[@]}" --attention full \
  --max-new-tokens 6 --temperature 0.7 --top-k 3 --seed 4
# Sampling with a seed is reproducible.
g1="$("$bin" --threads 1 generate "${small[@]}" --max-new-tokens 8 --seed 9 | grep generated)"
g2="$("$bin" --threads 1 generate "${small[@]}" --max-new-tokens 8 --seed 9 | grep generated)"
if [ -n "$g1" ] && [ "$g1" = "$g2" ]; then echo "ok: generate --seed is reproducible"
else echo "FAIL: generate --seed: '$g1' vs '$g2'"; failures=$((failures + 1)); fi
expect 2 "--prefix tokens must be in \[0, --vocab = 11\), got 11" -- generate "${small[@]}" --prefix 11
expect 2 "--top-k must be in \[1, --vocab = 11\]" -- generate "${small[@]}" --top-k 0
expect 2 "--temperature must be a finite number > 0" -- generate "${small[@]}" --temperature 0
expect 2 "recurrent form \(aft-simple, causal-linear, full, hard-retrieval\), got 'linear'" -- generate --attention linear
expect 2 "--d-model \(10\) must be divisible by --heads \(4\)" -- generate --d-model 10 --heads 4
expect 0 "full +40 +[0-9.]+ +[0-9.]+x" -- --threads 1 generate --bench "${small[@]}" \
  --positions 8,40 --steps 2 --json "$tmp/g.json"
if [ -f "$tmp/g.json" ] && [ "$(grep -c '"ms_per_token"' "$tmp/g.json")" -eq 4 ]; then
  echo "ok: generate --bench --json wrote 4 records"
else
  echo "FAIL: generate --bench --json records"; head -40 "$tmp/g.json" 2>/dev/null
  failures=$((failures + 1))
fi

# ---- train -----------------------------------------------------------------------
expect 0 "usage: fastattn train" -- train --help
expect 2 "--task must be copy, transduction, digits or charlm, got 'nope'" -- train --task nope
expect 2 "--resume needs --checkpoint DIR" -- train --resume
expect 2 "--optimizer must be adam, adamw or radam" -- train --optimizer sgd --steps 1
expect 2 "unknown attention type 'nope'" -- train --attention nope
expect 2 "--mode applies to --task transduction" -- train --mode sort
expect 2 "--layers and --config both set the model" -- train --config x.json --layers 2
expect 2 "mask_fraction" -- train --mask-fraction 0.9 --steps 1
tiny=(--task copy --length 6 --vocab 4 --layers 1 --heads 2 --d-model 16 --d-ff 32 --batch 8
      --eval-every 10 --eval-batches 2 --log-every 5)
expect 0 "step 30: accuracy" -- --threads 1 train "${tiny[@]}" --steps 30 \
  --checkpoint "$tmp/a" --metrics "$tmp/a.jsonl"
if [ "$(grep -c '"eval"' "$tmp/a.jsonl")" -eq 4 ] && grep -q '"event":"start"' "$tmp/a.jsonl" &&
   [ -f "$tmp/a/checkpoint.safetensors" ] && [ -f "$tmp/a/model.safetensors" ] &&
   ! ls "$tmp/a" | grep -q tmp; then
  echo "ok: train --metrics and --checkpoint files"
else
  echo "FAIL: train metrics/checkpoint files"; cat "$tmp/a.jsonl"; ls -la "$tmp/a"
  failures=$((failures + 1))
fi
# Stopped at 15 steps and resumed to 30 = 30 steps uninterrupted, bit for bit.
expect 0 "step 15: accuracy" -- --threads 1 train "${tiny[@]}" --steps 15 --checkpoint "$tmp/b"
expect 0 "step 20/30 loss" -- --threads 1 train --checkpoint "$tmp/b" --resume --steps 30
if cmp -s "$tmp/a/model.safetensors" "$tmp/b/model.safetensors" &&
   cmp -s "$tmp/a/checkpoint.safetensors" "$tmp/b/checkpoint.safetensors"; then
  echo "ok: train --resume equals the uninterrupted run (byte-identical checkpoints)"
else
  echo "FAIL: resumed checkpoint differs from the uninterrupted one"
  failures=$((failures + 1))
fi
expect 1 "optimizer: checkpoint .*\"lr\":0.001" -- --threads 1 train --checkpoint "$tmp/b" --resume --lr 0.5
head -c 1000 "$tmp/b/checkpoint.safetensors" > "$tmp/b/cut" && mv "$tmp/b/cut" "$tmp/b/checkpoint.safetensors"
expect 1 "checkpoint.safetensors.*truncated" -- train --checkpoint "$tmp/b" --resume
expect 0 "step 4: exact_match" -- --threads 1 train --task transduction --mode sort --vocab 4 \
  --min-length 2 --max-length 5 --layers 1 --heads 2 --d-model 16 --steps 4 --batch 4 \
  --eval-every 2 --eval-batches 1 --attention full --cross-attention full:softmax_temp=0.5

# ---- eval ------------------------------------------------------------------------
expect 0 "usage: fastattn eval" -- eval --help
expect 2 "--checkpoint DIR is required" -- eval
expect 0 "step 4: exact_match" -- --threads 1 train --task transduction --vocab 4 \
  --min-length 2 --max-length 5 --layers 1 --heads 2 --d-model 16 --steps 4 --batch 4 \
  --eval-every 4 --eval-batches 1 --checkpoint "$tmp/t"
expect 0 "decode \(step, batch 4\)" -- --threads 1 eval --checkpoint "$tmp/t" \
  --decoder-attention hard-retrieval --cross-attention hard-retrieval --json "$tmp/t.json"
if grep -q '"ms_per_step"' "$tmp/t.json" && grep -q '"exact_match"' "$tmp/t.json"; then
  echo "ok: eval --json"
else
  echo "FAIL: eval --json"; cat "$tmp/t.json"; failures=$((failures + 1))
fi
expect 0 "decode \(rerun, batch 4\)" -- --threads 1 eval --checkpoint "$tmp/t" --decode rerun
expect 1 "lacks parameters" -- --threads 1 eval --checkpoint "$tmp/t" --attention clusterformer
expect 2 "--cross-attention applies to transduction" -- --threads 1 eval --checkpoint "$tmp/a" \
  --cross-attention full
expect 0 "accuracy" -- --threads 1 eval --checkpoint "$tmp/a" --attention exact-topk:topk=4
# ---- decoder-only tasks and generation from their checkpoints ---------------------
expect 2 "--conditional applies to --task digits" -- train --task copy --conditional
expect 2 "--vocab applies to --task copy or transduction" -- train --task charlm --vocab 3
expect 2 "--length applies to --task copy or charlm" -- train --task digits --length 3
expect 2 "--samples needs --checkpoint DIR" -- generate --samples 3
expect 2 "--prompt needs --checkpoint DIR" -- generate --prompt "the"
awk 'BEGIN { srand(1); for (i = 0; i < 16000; i++) printf "%s ", (rand() < 0.5 ? "the cat" : "a dog.") }' \
  > "$tmp/corpus.txt"
lm=(--layers 1 --heads 2 --d-model 16 --d-ff 32 --batch 4 --eval-every 0 --eval-batches 1)
expect 0 "step 3: bits_per_char" -- --threads 1 train --task charlm --data "$tmp/corpus.txt" \
  --length 16 "${lm[@]}" --attention causal-linear --steps 3 --checkpoint "$tmp/lm" \
  --result "$tmp/lm.json"
if grep -q '"bits_per_char"' "$tmp/lm.json" && grep -q '"train_seconds"' "$tmp/lm.json"; then
  echo "ok: train --result"
else
  echo "FAIL: train --result"; cat "$tmp/lm.json"; failures=$((failures + 1))
fi
expect 0 "generate: 2 sequences in .*recurrent form" -- --threads 1 generate \
  --checkpoint "$tmp/lm" --prompt "the cat" --max-new-tokens 10 --samples 2 --seed 3
expect 0 "^the cat" -- --threads 1 generate --checkpoint "$tmp/lm" --prompt "the cat" \
  --max-new-tokens 10 --greedy
expect 2 "--label applies to --task digits \(the checkpoint.s task is charlm\)" -- \
  generate --checkpoint "$tmp/lm" --label 3
expect 2 "does not occur in the corpus" -- generate --checkpoint "$tmp/lm" --prompt "zebra"
expect 2 "--top-k does not apply to --checkpoint" -- generate --checkpoint "$tmp/lm" --top-k 3
expect 2 "trained on --task copy" -- generate --checkpoint "$tmp/a"
if [ -f "${FASTATTN_DIGITS:-/nonexistent}" ] ||
   [ -f /usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz ] ||
   [ -f /usr/local/share/fastattn/data/digits.csv.gz ]; then
  expect 0 "step 2: bits_per_dim" -- --threads 1 train --task digits --conditional "${lm[@]}" \
    --attention causal-linear --steps 2 --checkpoint "$tmp/dg"
  expect 0 "generate: 3 images in .*recurrent form" -- --threads 1 generate --checkpoint "$tmp/dg" \
    --samples 3 --label 7 --pgm "$tmp/dg.pgm"
  expect 2 "--max-new-tokens applies to --task charlm \(the checkpoint.s task is digits\)" -- \
    generate --checkpoint "$tmp/dg" --max-new-tokens 3
  if head -c 2 "$tmp/dg.pgm" | grep -q P5; then echo "ok: generate --pgm"
  else echo "FAIL: generate --pgm"; failures=$((failures + 1)); fi
else
  echo "skipped: digits (no digits.csv.gz; scripts/install_deps.sh extracts it)"
fi
# approx: usage errors and a clear message without the model (the real run is
# MiniLMTest.* in the C++ suite and docs/approx.md).
expect 0 "usage: fastattn approx" -- approx --help
expect 2 "unknown attention type 'nope'" -- approx --attention nope
expect 2 "--passages must be >= 2" -- approx --passages 1
printf 'Package: a\nDescription-en: A\n one two three\n' > "$tmp/corpus"
expect 1 "only 1 passages .* qualify" -- approx --corpus "$tmp/corpus" --min-words 1 --model "$tmp/none"
printf '\nPackage: b\nDescription-en: B\n four five\n' >> "$tmp/corpus"
expect 1 "$tmp/none/vocab.txt.*cannot open" -- approx --corpus "$tmp/corpus" --min-words 1 \
  --neighbours 1 --model "$tmp/none"

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
