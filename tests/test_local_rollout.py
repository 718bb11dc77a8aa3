"""LocalRollout's DataProto has veRL 0.6.0 SGLangRollout's batch-path layout, computed independently here."""

from __future__ import annotations

import torch

from conftest import tiny_config
from final.config import load_config
from final.prompts import Prompt, build_dataproto
from final.rollout.local import LocalRollout


def make_rollout(tiny_dir, **rollout):
    cfg = load_config(tiny_config(**rollout))
    return LocalRollout(cfg.rollout_config(), cfg.model_config(tiny_dir))


def test_batch_path_layout(tiny_dir, tiny_engine):
    rollout = LocalRollout(*_configs(tiny_dir, response_length=8), engine=tiny_engine)
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11]]
    data = build_dataproto(prompts, [Prompt(ids=p) for p in prompts], pad_token_id=2, eos_token_ids=[2],
                           meta_info={"do_sample": False})
    before = set(data.non_tensor_batch)
    out = rollout.generate_sequences(data, max_new_tokens=5)
    assert set(data.non_tensor_batch) == before  # the caller's DataProto is not altered
    b = out.batch
    assert set(b.keys()) == {"prompts", "responses", "input_ids", "attention_mask", "position_ids",
                             "rollout_log_probs"}
    assert b["prompts"].shape == (3, 5) and b["responses"].shape == (3, 8) and b["input_ids"].shape == (3, 13)
    assert all(b[k].dtype == torch.long for k in ("prompts", "responses", "input_ids", "attention_mask",
                                                     "position_ids"))
    assert b["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    for row, p in enumerate(prompts):
        solo = tiny_engine.generate(p, {"max_new_tokens": 5, "temperature": 0})
        ids = solo["output_ids"]
        assert b["responses"][row, :len(ids)].tolist() == ids
        assert (b["responses"][row, len(ids):] == 2).all()  # right-padded with pad_token_id
        # veRL pads logprobs with pad_token_id too
        assert (b["rollout_log_probs"][row, len(ids):] == 2.0).all()
        # position ids continue from the last prompt position
        last = b["position_ids"][row, 4].item()
        assert b["position_ids"][row, 5:].tolist() == list(range(last + 1, last + 9))
        # attention: prompt mask then get_response_mask (1 up to and including the first eos)
        resp = b["responses"][row].tolist()
        keep = resp.index(2) + 1 if 2 in resp else 8
        assert b["attention_mask"][row, 5:].tolist() == [1] * keep + [0] * (8 - keep)
    assert "raw_prompt_ids" not in out.non_tensor_batch


def test_logprobs_only_when_configured(tiny_dir, tiny_engine):
    rollout = LocalRollout(*_configs(tiny_dir, calculate_log_probs=False), engine=tiny_engine)
    data = build_dataproto([[1, 5, 6]], [Prompt(ids=[1, 5, 6])], 2, [2])
    assert "rollout_log_probs" not in rollout.generate_sequences(data).batch.keys()


def test_update_weights_streams_hf_parameters(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from final.models import resolve_model_path

    rollout = make_rollout(tiny_dir)
    data = build_dataproto([[1, 5, 6]], [Prompt(ids=[1, 5, 6])], 2, [2], meta_info={"do_sample": False})
    before = rollout.generate_sequences(data).batch["responses"]
    other = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-random-qwen2"))
    llama = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():  # a "trained" llama: same shapes, different values
        for p in llama.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    import asyncio

    asyncio.run(rollout.update_weights(iter(llama.state_dict().items())))
    after = rollout.generate_sequences(data).batch["responses"]
    ref = llama.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=16, do_sample=False, eos_token_id=2,
                         pad_token_id=2)[0, 3:]
    assert not torch.equal(before, after)
    assert after[0, :len(ref)].tolist() == ref.tolist()
    del other
    rollout.shutdown()


def _configs(tiny_dir, **rollout):
    cfg = load_config(tiny_config(**rollout))
    return cfg.rollout_config(), cfg.model_config(tiny_dir)
