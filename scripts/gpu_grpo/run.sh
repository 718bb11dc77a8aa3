#!/bin/bash
# examples/grpo.py on CUDA (assembled by scripts/gpu_grpo/prepare.sh): veRL 0.9.1 lane wheels (no Ray: a stand-in),
# final + the example from src/.
set -o pipefail
G=.grpo-gpu
. "$(dirname "$0")/gpu_env.sh"  # copied beside this script by prepare.sh
gpu_env $G/whl/*.whl -- $G/raystub $G/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== 1. the example's CLI on the tiny model, --device cuda, veRL's GSM8K reward"
python3 $G/src/examples/grpo.py --device cuda --model $G/tiny --steps 2 --prompts 2 --n 4 --max-tokens 8 \
  --eval-problems 8 --out $OUT/tiny 2>&1 | grep -v -i warn
echo "== 2. final generate --model on the saved policy"
python3 -m final.cli generate --model $OUT/tiny/policy --temperature 0 --max-tokens 8 "What is 2 + 3?" 2>&1 | tail -3
echo "== 3. default sizes (8 prompts x 8, 48 tokens) on a SmolLM2-shaped random model, policy + engine on CUDA"
python3 $G/driver.py $OUT/smol 2>&1 | grep -v -i warn
rm -rf $OUT/tiny/policy $OUT/smol/policy
