#!/bin/bash
# examples/grpo.py on CUDA (assembled by scripts/gpu_grpo/prepare.sh): veRL 0.9.1 lane wheels (no Ray: a stand-in),
# final + the example from src/.
set -o pipefail
G=.grpo-gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $G/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$G/raystub:$G/src PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error FINAL_CACHE=/tmp/fc
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, verl; print(torch.__version__, transformers.__version__, verl.__version__, torch.cuda.is_available())"
echo "== 1. the example's CLI on the tiny model, --device cuda, veRL's GSM8K reward"
python3 $G/src/examples/grpo.py --device cuda --model $G/tiny --steps 2 --prompts 2 --n 4 --max-tokens 8 \
  --eval-problems 8 --out $OUT/tiny 2>&1 | grep -v -i warn
echo "== 2. final generate --model on the saved policy"
python3 -m final.cli generate --model $OUT/tiny/policy --temperature 0 --max-tokens 8 "What is 2 + 3?" 2>&1 | tail -3
echo "== 3. default sizes (8 prompts x 8, 48 tokens) on a SmolLM2-shaped random model, policy + engine on CUDA"
python3 $G/driver.py $OUT/smol 2>&1 | grep -v -i warn
rm -rf $OUT/tiny/policy $OUT/smol/policy
