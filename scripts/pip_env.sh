#!/usr/bin/env bash
# The environment fastattn's Python users have: a virtual environment with
# PyTorch 2.x from PyPI, fastattn pip-installed into it from this tree.
#
#   scripts/pip_env.sh            create/update the venv, pip install fastattn
#   scripts/pip_env.sh --test     ... then run the Python suite in it
#
# Environment:
#   FASTATTN_VENV         the venv (default: .venv in the source tree)
#   FASTATTN_WHEELS       wheel cache (default: ~/.cache/fastattn/wheels); the
#                         torch wheels (~3 GB with their CUDA libraries) are
#                         downloaded once and installed from here
#   FASTATTN_TORCH        the torch requirement (default: torch, the newest)
#   FASTATTN_CUDA         0: CPU operators only (fast); 1: CUDA too; unset: CUDA
#                         when torch has it and nvcc is found
#   PYTEST_ARGS           extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
venv="${FASTATTN_VENV:-$root/.venv}"
wheels="${FASTATTN_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/fastattn/wheels}"
torch_req="${FASTATTN_TORCH:-torch}"
# What the tests need beside torch (transformers: tests/python/test_hf.py, the
# fastattn.hf backend); scikit-build-core builds the package.
reqs=("$torch_req" numpy pytest "transformers>=5.0" "scikit-build-core>=0.10")

stamp() { printf '[pip_env %s] %s\n' "$(date +%T)" "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  stamp "creating $venv (Debian's python3 with python3-venv)"
  /usr/bin/python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# Download what is missing from the cache (the newest torch unless
# FASTATTN_TORCH pins one); without the index, install from the cache alone.
mkdir -p "$wheels"
stamp "resolving ${reqs[*]} into $wheels"
if ! "${pip[@]}" download -q -d "$wheels" "${reqs[@]}"; then
  stamp "PyPI not reachable: installing from $wheels only"
fi
stamp "installing into $venv"
"${pip[@]}" install -q --no-index --find-links "$wheels" "${reqs[@]}"
stamp "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"

# The build uses the environment's torch (--no-build-isolation: the build
# requirements are already there; cmake/torch.cmake finds torch either way).
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
stamp "pip install --no-build-isolation . (build dir build/pip-*, FASTATTN_CUDA=${FASTATTN_CUDA:-auto})"
"${pip[@]}" install -q --no-build-isolation --no-deps --force-reinstall .
stamp "installed: $("$venv/bin/python" -c 'import fastattn; print(fastattn.library_path, fastattn.build_info)')"

if [ "${1:-}" = "--test" ]; then
  # From outside the tree, so that `import fastattn` is the installed package.
  cd /tmp
  stamp "pytest $root/tests/python"
  # shellcheck disable=SC2086
  env -u FASTATTN_LIBRARY "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    "$root/tests/python" ${PYTEST_ARGS:-}
fi
