"""Shared pieces of the LoRA tests: real PEFT adapter folders (peft's get_peft_model + save_pretrained on a real
model) and HF + PEFT's greedy tokens and log-probs, the reference every backend is held to."""

from __future__ import annotations

from pathlib import Path

import torch

# (name, LoraConfig keywords): every module kind, a subset with per-module rank/alpha and rsLoRA, a larger rank
ADAPTERS = {
    "all": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
    "qvd": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": True,
            "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"down_proj": 4}},
    "mlp": {"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "o_proj", "k_proj"]},
}


def peft_model(model_dir: str, seed: int, b_scale: float = 2.0, **config):
    """A PeftModel of the model with a LoRA adapter whose B is not zero (init_lora_weights=False: a trained one),
    PEFT's random B times b_scale."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **config))
    with torch.no_grad():  # PEFT's random init with kaiming A and B: scaled so the adapter moves greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    return model.eval()


def write_adapter(model_dir: str, dest: Path, seed: int, b_scale: float = 2.0, **config) -> str:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) written by peft itself."""
    peft_model(model_dir, seed, b_scale, **config).save_pretrained(str(dest))
    return str(dest)


def load_peft(model_dir: str, folder: str):
    """HF's model with the adapter folder loaded by PEFT (PeftModel.from_pretrained), fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, folder).eval()


@torch.no_grad()
def hf_rows(model, prompt_ids: list[list[int]], max_new_tokens: int, eos: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt: HF generate's greedy tokens (cut after eos, as the engine stops there) and each token's
    log-prob from one forward pass over prompt + tokens (fp32 log_softmax)."""
    out = []
    for ids in prompt_ids:
        got = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos,
                             eos_token_id=eos)[0, len(ids):].tolist()
        if eos in got:
            got = got[:got.index(eos) + 1]
        logits = model(input_ids=torch.tensor([ids + got])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)[len(ids) - 1:-1].gather(1, torch.tensor(got)[:, None])
        out.append((got, logprobs[:, 0].tolist()))
    return out
