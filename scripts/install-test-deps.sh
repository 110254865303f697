#!/usr/bin/env bash
# Installs what the test suite needs beyond pip's '.[test]': the Mooncake Store
# client and master ('.[mooncake]', PyPI mooncake-transfer-engine-non-cuda) with
# the three Debian libraries its shared objects load, and CPU torch and
# transformers for the Hugging Face check ('.[hf]'). Run from the repository
# root with the venv already made: scripts/install-test-deps.sh [.venv]
set -euo pipefail
venv="${1:-.venv}"
libs=(libibverbs1 libnl-3-200 libnl-route-3-200)
missing=()
for lib in "${libs[@]}"; do
    dpkg -s "$lib" >/dev/null 2>&1 || missing+=("$lib")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
"$venv/bin/pip" install -q -e '.[test,mooncake,hf]'
