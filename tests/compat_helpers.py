"""Cartridges as the HazyResearch cartridges repo writes them, built with HF transformers, and HF's own logprobs
for the tokens after them under either position convention (the reference the compat tests compare against).

June 2025 files: torch.save({trainable_keys, trainable_values, fixed_keys, fixed_values}) of nn.ParameterLists
(TrainableCache.save); later files name the frozen part frozen_keys/frozen_values. Runs save cache-step{N}.pt and
a cache_last.pt symlink, with the run's config.yaml beside them (W&B's {desc, value} shape)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn as nn
import yaml

TINY = "builtin:tiny-random-llama"
DOC = ("The lighthouse keeper of Orvanis is called Mara Quill. She keeps three cats named Pip, Jot and Fennel, "
       "and the lamp is lit at dusk.")
CONTINUATION = "Question: who keeps the lighthouse? Answer: Mara Quill keeps it, with Pip, Jot and Fennel."
# what each version of the cartridges repo writes in its run config (W&B wraps every top-level key)
JUNE_CONFIG = {"dataset": {"desc": None, "value": {"label_type": "logits", "max_sequence_length": 1024}},
               "kv_cache_initializer": {"desc": None, "value": {"max_tokens": 2048}}}
LATER_CONFIG = {"dataset": {"desc": None, "value": {"packed_seq_length": 2048, "packing_mode": "pad",
                                                    "targets": "logits"}},
                "kv_cache_initializer": {"desc": None, "value": {"max_tokens": 2048}}}


def hf_model(model: str = TINY):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from final.models import resolve_model_path

    path = resolve_model_path(model)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def hf_cartridge(model, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer post-RoPE K/V [1, Hkv, T, D] of `ids` at positions 0..T-1, as HF's forward stores them."""
    cache = model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=True).past_key_values
    return [layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers]


@torch.no_grad()
def hf_logprobs(model, keys, values, ids: list[int], start: int) -> list[float]:
    """log p(ids[j] | cartridge, ids[:j]) for j >= 1, the tokens after the cartridge at positions start.."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k.clone(), v.clone(), i)
    out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True,
                position_ids=torch.arange(start, start + len(ids))[None])
    logp = torch.log_softmax(out.logits[0].float(), -1)
    return [logp[j - 1, ids[j]].item() for j in range(1, len(ids))]


def save_repo_file(keys, values, path: Path, *, layout: str, frozen: int = 1) -> Path:
    """The file TrainableCache.save writes: ParameterLists, the first `frozen` tokens in the frozen part."""
    names = {"june": ("fixed_keys", "fixed_values"), "later": ("frozen_keys", "frozen_values")}[layout]

    def plist(ts, grad):
        return nn.ParameterList([nn.Parameter(t.contiguous(), requires_grad=grad) for t in ts])

    obj = {"trainable_keys": plist([k[:, :, frozen:] for k in keys], True),
           "trainable_values": plist([v[:, :, frozen:] for v in values], True),
           names[0]: plist([k[:, :, :frozen] for k in keys], False),
           names[1]: plist([v[:, :, :frozen] for v in values], False)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    return path


def write_run(folder: Path, keys, values, *, layout: str, config: dict | None, step: int = 64) -> Path:
    """A run folder as the cartridges repo leaves it: cache-step{N}.pt, cache_last.pt -> it, config.yaml."""
    save_repo_file(keys, values, folder / f"cache-step{step}.pt", layout=layout)
    os.symlink(f"cache-step{step}.pt", folder / "cache_last.pt")
    if config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder / "cache_last.pt"


@functools.lru_cache(maxsize=1)  # one HF model load per test process
def reference() -> dict:
    """The test cartridge (DOC at positions 0..p-1, HF's K/V) and HF's logprobs of CONTINUATION after it at p
    (after_prefix) and at 0 (from_zero)."""
    model, tok = hf_model()
    doc = tok(DOC).input_ids  # the BOS is the cartridge's first (frozen) token, as the repo initialises it
    cont = tok(CONTINUATION, add_special_tokens=False).input_ids
    keys, values = hf_cartridge(model, doc)
    return {"keys": keys, "values": values, "cont": cont, "p": len(doc),
            "after_prefix": hf_logprobs(model, keys, values, cont, len(doc)),
            "from_zero": hf_logprobs(model, keys, values, cont, 0)}
