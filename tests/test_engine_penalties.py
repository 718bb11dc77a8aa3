"""The embedded engine's penalties are SGLang's (sglang/srt/sampling/penaltylib, 0.5.12's; 0.5.2 lacks the
repetition penalizer and its backend refuses the key): on the logits before temperature, presence and frequency
over the generated tokens (subtracted), then repetition over the generated tokens only - not HF's prompt+output.
Checked step by step against HF's logits for the same ids with SGLang's rules written out."""

from __future__ import annotations

import pytest
import torch

PROMPT = [1, 504, 3458, 282, 4289, 30, 2, 504, 504]  # repeated prompt ids: HF's rule would penalise them


def sglang_rules(logits: torch.Tensor, output: list[int], presence: float, frequency: float,
                 repetition: float) -> torch.Tensor:
    """penaltylib: BatchedPresencePenalizer and BatchedFrequencyPenalizer (additive), then
    BatchedRepetitionPenalizer's apply_scaling_penalties, over the output tokens."""
    logits = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
    logits -= frequency * counts + presence * (counts > 0).float()
    scale = torch.where(counts > 0, torch.tensor(repetition), torch.tensor(1.0))
    return torch.where(logits < 0, logits * scale, logits / scale)


# penalties that favour tokens already generated, so that the greedy path changes (the random tiny model does not
# repeat itself unprompted); the prompt repeats 504, which HF's prompt+output rule would favour too
@pytest.mark.parametrize("presence, frequency, repetition", [(0.0, 0.0, 0.5), (-2.0, -2.0, 1.0), (0.5, 0.0, 0.7)])
def test_greedy_rows_follow_sglangs_penalties_over_the_output(tiny_engine, tiny_dir, presence, frequency, repetition):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "presence_penalty": presence,
              "frequency_penalty": frequency, "repetition_penalty": repetition}
    out = tiny_engine.generate(PROMPT, params)["output_ids"]
    want: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            logits = hf(torch.tensor([PROMPT + want])).logits[0, -1].float()
            want.append(int(sglang_rules(logits, want, presence, frequency, repetition).argmax()))
    assert out == want
    plain = tiny_engine.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})["output_ids"]
    assert out != plain  # the penalty changed the greedy path: the comparison above is not vacuous


def test_the_prompt_is_not_penalised():
    """apply_penalties on a row whose prompt holds tokens the output never made: their logits stay as they were."""
    from final.engine.sampler import apply_penalties
    from final.engine.sampling_params import SamplingParams
    from final.engine.sequence import Sequence

    params = SamplingParams.from_dict({"max_new_tokens": 4, "repetition_penalty": 1.7, "presence_penalty": 0.3})
    seq = Sequence(rid="r", prompt_ids=[5, 6, 7], params=params, max_new_tokens=4, stop_ids=frozenset(),
                   generator=None, output_ids=[7, 8, 8])
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0, -3.0, 4.0, -4.0, 0.0]])
    got = logits.clone()
    apply_penalties(got, [seq])
    want = sglang_rules(logits[0], [7, 8, 8], 0.3, 0.0, 1.7)
    assert torch.allclose(got[0], want)
    assert got[0, 5] == 3.0 and got[0, 6] == -3.0  # prompt-only tokens: untouched
    assert got[0, 7] == pytest.approx((4.0 - 0.3) / 1.7) and got[0, 8] == pytest.approx((-4.0 - 0.3) * 1.7)
