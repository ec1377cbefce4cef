#!/usr/bin/env bash
# Installs what the experiment plots need on top of scripts/install_deps.sh:
# Debian's matplotlib for /usr/bin/python3 (scripts/experiments/plot.py).
# Not part of `make test`. Idempotent.
set -euo pipefail
bash "$(dirname "$0")/install_deps.sh"
if ! dpkg-query -W -f='${Status}' python3-matplotlib 2>/dev/null | grep -q "install ok installed"; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "fastattn: installing Debian packages: python3-matplotlib"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-matplotlib
fi
