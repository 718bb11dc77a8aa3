"""GPU check of examples/grpo.py at its default sizes on a SmolLM2-shaped model with random weights (the real
SmolLM2 cannot travel): the policy and the engine on CUDA, timings per step; the reward is a rule with spread on
random text (odd length), since such a model never writes '#### N'."""
import json, shutil, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent / "src" / "examples"))
import grpo
from transformers import AutoConfig, AutoModelForCausalLM

here = Path(__file__).parent
folder = Path("/tmp/smol_random")
cfg = AutoConfig.from_pretrained(here / "smol_config.json")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
with torch.no_grad():  # random init's std 0.02 gives near-uniform logits: scale up for some structure
    for p in model.parameters():
        if p.dim() == 2:
            p.mul_(3.0)
model.save_pretrained(folder)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (here / "tiny" / f).exists():
        shutil.copy(here / "tiny" / f, folder / f)
out = Path(sys.argv[1])
result = grpo.main(["--model", str(folder), "--device", "cuda", "--steps", "4", "--eval-problems", "64",
                    "--out", str(out)], reward=lambda text, answer: float(len(text) % 2))
print(json.dumps({k: result[k] for k in ("difference", "wall_s")}))
print("per step:", [(h["version"], round(h["gen_s"], 2), round(h["train_s"], 2), h["sync_ms"] and round(h["sync_ms"], 1),
                     f"{h['gap']:.1e}") for h in result["history"]])
