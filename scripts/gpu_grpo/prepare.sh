#!/usr/bin/env bash
# Assemble .grpo-gpu/ (ignored; 36 MB) for a GPU check of examples/grpo.py on a machine whose Python 3.12 image has
# torch + transformers but no veRL, Ray or network: the veRL 0.9.1 lane's wheels (pip download, run here), a copy
# of final/ and the example, the tiny model (from .venv-verl09's cache: transformers 5's layout), the driver, and a
# stand-in for Ray (veRL imports it at module level; its wheel is over the 64 MiB a device call carries; the
# in-process InferenceEngine never calls it). Then, on the GPU machine: `bash .grpo-gpu/run.sh` (device tool: carry
# [".grpo-gpu"]). Run `FINAL_LANE=verl09 bash scripts/install.sh` first.
set -euo pipefail
cd "$(dirname "$0")/../.."
G=.grpo-gpu
grep -qx "/$G/" .git/info/exclude 2>/dev/null || echo "/$G/" >> .git/info/exclude
rm -rf $G && mkdir -p $G/whl $G/src/examples
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $G/whl \
  verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.0 \
  codetiming==1.4.0 cachetools==8.0.2 orjson==3.13.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  typing-inspection==0.4.5 annotated-types==0.8.0
python3 -m pip wheel -q --no-deps -w $G/whl antlr4-python3-runtime==4.9.3  # omegaconf's; PyPI has only its sdist
cp -r final $G/src/final && find $G/src/final -name __pycache__ -prune -exec rm -rf {} + && rm -f $G/src/final/engine/kernels/*.so
cp examples/grpo.py $G/src/examples/
cp -r scripts/gpu_grpo/raystub scripts/gpu_grpo/driver.py scripts/gpu_grpo/smol_config.json scripts/gpu_grpo/run.sh scripts/gpu_env.sh $G/
cp -r "$(.venv-verl09/bin/python -c 'from final.models import resolve_model_path as r; print(r("builtin:tiny-random-llama"))')" $G/tiny
du -sh $G
