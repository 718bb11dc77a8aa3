"""`final cartridge distill --rollout verl` end to end on CPU: veRL's AgentLoopManager -> the tokasaurus replica ->
`final serve` (all started by the loop) for three steps, the cartridge rewritten between them. The server served
each step's rewritten file: the student's samples of steps 2 and 3 (T=1, seeded) equal what the in-process engine
samples with the file as the previous step left it, and those files differ (so do their logprobs). Its own module:
veRL 0.6.0 allows one AgentLoopManager per Ray at a time, and test_training_verl.py holds one for its module."""

from __future__ import annotations

import shutil

import pytest

from conftest import TINY
from serve_helpers import DOC_A
from final.training.onpolicy.loop import distill
from final.training.settings import DistillConfig, SynthConfig
from final.prompts import continuation_ids


@pytest.fixture(scope="module")
def inference():
    from final.inf import local_engine

    with local_engine(TINY, dtype="float32") as engine:
        yield engine


def test_distill_through_verl_serves_each_steps_rewritten_cartridge(inference, tmp_path):
    cfg = DistillConfig(tokens=8, steps=3, questions=2, n=2, answer_tokens=6, top_k=4, lr=5e-2, rollout="verl",
                        init_questions=2, validate=2,
                        synth=SynthConfig(min_chunk_tokens=16, max_chunk_tokens=24, question_tokens=6))
    out = tmp_path / "student.pt"
    copies = []

    def keep(rec: dict, cache) -> None:  # the file as this step left it: what the next step's rollout must read
        copies.append(shutil.copy(out, tmp_path / f"after-{rec['step']}.pt"))

    history = distill(inference, DOC_A, out, cfg, model=TINY, dtype="float32", progress=False, on_step=keep)
    assert [r["step"] for r in history] == [1, 2, 3] and all(r["tail_kl"] >= 0 for r in history)
    probe = [continuation_ids(inference.tokenizer, [{"role": "user", "content": "Who keeps the lighthouse?"}])]
    logprobs = []
    for step in (2, 3):
        rec, file = history[step - 1], copies[step - 2]
        cid = inference.load_cartridge(id=f"after-{step - 1}", path=str(file))
        prompts = [continuation_ids(inference.tokenizer, [{"role": "user", "content": q}]) for q in rec["questions"]]
        want = inference.generate(prompts, cartridge=cid, n=cfg.n, temperature=cfg.temperature,
                                  max_tokens=cfg.answer_tokens, seed=cfg.seed * 1_000_003 + (step - 1) * 1009 + 1)
        assert rec["samples"] == [list(t) for t in want.token_ids]
        lp = inference.score(probe, top_logprobs=0, cartridge=cid)[0].prompt_logprobs[1:]
        logprobs.append(lp)
        inference.unload_cartridge(cid)
    assert logprobs[0] != pytest.approx(logprobs[1], abs=1e-6)
