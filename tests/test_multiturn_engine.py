"""The multi-turn rollout on the real embedded engine (random 2-layer Llama): the model's tokens are the engine's
own greedy tokens, runs are deterministic, cartridges and logprobs reach the engine, and the engine keeps serving."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from final.engine.engine import EmbeddedEngine
from final.models import resolve_model_path
from final.rollout.multi_turn import MultiTurnRollout
from multiturn_helpers import chat_batch, make_tool_model, rollout_config

ROOT = Path(__file__).resolve().parents[1]
USERS = ["Natalia sold clips to 48 of her friends.", "Weng earns $12 an hour.", "Hi"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import verl.workers.rollout.schemas as schemas

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)
    path = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("tm") / "m")
    engine = EmbeddedEngine(path)
    yield engine, AutoTokenizer.from_pretrained(path)
    engine.shutdown()


def batch(tok, tools: bool = True, **meta):
    kwargs = [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}, {}, {"calc_gsm8k_reward": {}}]
    return chat_batch(tok, [[{"role": "user", "content": u}] for u in USERS], kwargs if tools else None, **meta)


def test_tools_on_the_real_engine_are_deterministic(model):
    engine, tok = model
    config = rollout_config(multi_turn={"tool_config_path": str(ROOT / "tools.yaml")}, response_length=48)
    rollout = MultiTurnRollout(engine, config, tok)
    first, second = rollout.generate_sequences(batch(tok)), rollout.generate_sequences(batch(tok))
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(first.batch[key], second.batch[key]), key
    b = first.batch
    assert b["responses"].shape == (3, 48)
    assert (b["response_mask"] <= b["attention_mask"][:, -48:]).all()
    assert [sorted(r) for r in first.non_tensor_batch["reward_scores"]] == [
        ["calc_gsm8k_reward", "user_turn_rewards"], ["user_turn_rewards"], ["calc_gsm8k_reward", "user_turn_rewards"]]


def test_single_turn_tokens_are_the_engines_greedy_tokens(model):
    engine, tok = model
    config = rollout_config(response_length=24)  # multi-turn on, no tools: one assistant turn per row
    out = MultiTurnRollout(engine, config, tok).generate_sequences(batch(tok, tools=False))
    for i, user in enumerate(USERS):
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False))["input_ids"]  # veRL tokenizes the rendered text
        direct = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0})["output_ids"]
        n = int(out.batch["attention_mask"][i, -24:].sum())
        assert out.batch["responses"][i, :n].tolist() == direct
        assert out.batch["response_mask"][i, :n].tolist() == [1] * n


def test_cartridges_and_logprobs_reach_the_engine(model):
    engine, tok = model
    spec = engine.spec
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(spec.num_kv_heads, 5, spec.head_dim, generator=gen) for _ in range(spec.num_layers)]
    engine.load_cartridge("doc", kv, [k * 0.5 for k in kv])
    try:
        config = rollout_config(response_length=16, calculate_log_probs=True)
        data = batch(tok, tools=False)
        plain = MultiTurnRollout(engine, config, tok).generate_sequences(data)
        data.non_tensor_batch["cartridges"] = data.non_tensor_batch["raw_prompt"].copy()
        data.non_tensor_batch["cartridges"][:] = [("doc",), (), ("doc",)]
        with_doc = MultiTurnRollout(engine, config, tok).generate_sequences(data)
        prompt = with_doc.batch["input_ids"][0][with_doc.batch["attention_mask"][0, :-16].nonzero()].flatten()
        direct = engine.generate(prompt.tolist(), {"max_new_tokens": 16, "temperature": 0}, cartridges=("doc",))
        n = len(direct["output_ids"])
        assert with_doc.batch["responses"][0, :n].tolist() == direct["output_ids"]
        assert torch.equal(with_doc.batch["responses"][1], plain.batch["responses"][1])  # row 1 has no cartridge
        # veRL's calculate_log_probs path: a zero-token scoring call, keeping (as veRL does) only the last logprob
        assert with_doc.batch["rollout_log_probs"].shape == (3, 16)
        assert (with_doc.batch["rollout_log_probs"][:, 1:] == 0).all()
        assert (with_doc.batch["rollout_log_probs"][:, 0] < 0).all()
    finally:
        engine.unload_cartridge("doc")
    # the engine still serves plain requests afterwards
    assert len(engine.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})["output_ids"]) == 2
