"""The embedded engine against HF transformers as the numerical reference (greedy tokens, logits, logprobs)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from final.compat import chat_ids
from final.engine import EmbeddedEngine
from final.models import resolve_model_path

QUESTIONS = ["What is the capital of France?", "Hi", "Write a long poem about the sea and the wind, please."]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_greedy_and_logits_match_hf(arch):
    path = resolve_model_path(f"builtin:tiny-random-{arch}")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(path)
    try:
        prompts = [chat_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in QUESTIONS]
        outs = engine.generate(prompts, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
                               return_logprob=True)
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(hf, prompt, 12, None)
            # logprobs of the chosen tokens equal HF's log_softmax over the same positions (fp32 tolerance)
            full = torch.tensor([prompt + out["output_ids"]])
            with torch.no_grad():
                ref = torch.log_softmax(hf(full).logits[0].float(), -1)
            ref_lp = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
            ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(ref_lp, ours)) < 1e-4
        # full-sequence logits of one forward pass
        logits, _ = engine.call(lambda r: r.forward_full(prompts[2], None))
        with torch.no_grad():
            ref_logits = hf(torch.tensor([prompts[2]])).logits[0].float()
        assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    finally:
        engine.shutdown()


def test_smollm2_greedy_matches_hf_and_knows_paris(smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    engine = EmbeddedEngine(smol_dir)
    try:
        prompts = [chat_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True)
                   for q in QUESTIONS]
        outs = engine.generate(prompts, {"max_new_tokens": 24, "temperature": 0})
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(hf, prompt, 24, 2)
        assert "Paris" in tok.decode(outs[0]["output_ids"])
        assert outs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    finally:
        engine.shutdown()


def test_prompt_logprobs_match_hf(tiny_engine, tiny_dir, tiny_tokenizer):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tiny_tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    out = tiny_engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt and entries[0][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for j in range(1, len(prompt)):
        assert abs(entries[j][0] - ref[j - 1, prompt[j]].item()) < 1e-4
