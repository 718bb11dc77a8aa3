"""Shared pieces of the weight-update tests (every backend): a "trained" copy of a model and HF's greedy answer."""

from __future__ import annotations

import torch

PROMPTS = ["hello there", "What is 2+2?", "abc def ghi"]


def perturbed(model_dir: str, scale: float = 0.3, seed: int = 0, only: str | None = None):
    """The model's HF copy with every parameter (or those whose name contains `only`) moved by noise: a policy
    after some training steps, same shapes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.float().std().clamp_min(1e-3))
    return model.eval()


def hf_greedy(model, prompt_ids: list[list[int]], max_new_tokens: int, eos: int | None = None) -> list[list[int]]:
    """HF generate's greedy tokens for each prompt (cut after eos, as the engine stops there)."""
    out = []
    for ids in prompt_ids:
        got = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos if eos is not None else 0,
                             eos_token_id=eos)[0, len(ids):].tolist()
        if eos is not None and eos in got:
            got = got[:got.index(eos) + 1]
        out.append(got)
    return out


def state_of(model, only: str) -> dict:
    """The parameters of `model` whose name contains `only` (a partial update)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if only in k}


def save_policy(model, model_dir: str, dest) -> str:
    """An HF folder of `model` with the original's tokenizer files (what a trainer saves, what a server loads)."""
    import shutil
    from pathlib import Path

    dest = Path(dest)
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.gguf"))
    model.save_pretrained(dest, safe_serialization=True)
    return str(dest)
