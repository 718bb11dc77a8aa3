"""The `select` initialisation (final/distill/select.py): the document's own KV, cut per head, keys moved so the
tokens after the cartridge see them at their distance in the document."""

from __future__ import annotations

import pytest
import torch

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.training.settings import DistillConfig
from final.training.start.select import attention_mass, select_init, select_kv, select_positions
from final.training.student import Student
from final.errors import CartridgeError
from final.models import resolve_model_path
from final.prompts import continuation_ids, document_ids

from training_helpers import inference  # noqa: F401  (the module's engine fixture, one rule)
from test_training_onpolicy import run_distill


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY), dtype="float32")


def test_each_head_keeps_the_frozen_sink_and_its_heaviest_positions_in_order():
    mass = torch.zeros(2, 3, 10, dtype=torch.float64)
    mass[0, 0, [7, 2, 9]] = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)  # position 0 gets nothing and is kept anyway
    mass[1, 2, [1, 4, 5]] = torch.tensor([1.0, 5.0, 4.0], dtype=torch.float64)
    pos = select_positions(mass, 4, frozen=1)
    assert pos.shape == (2, 3, 4)
    assert pos[0, 0].tolist() == [0, 2, 7, 9] and pos[1, 2].tolist() == [0, 1, 4, 5]
    assert (pos.diff(dim=-1) > 0).all()
    for p, frozen in ((11, 1), (4, 4)):
        with pytest.raises(CartridgeError) as err:
            select_positions(mass, p, frozen)
        assert err.value.field == "tokens"


def test_moved_keys_score_as_at_their_distance_in_the_document():
    """(R_{p+m} q)·(R_{p-L} k_j) == (R_{L+m} q)·k_j, with HF's own rotary embedding of the model."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    model_dir = resolve_model_path(TINY)
    config = AutoConfig.from_pretrained(str(model_dir))
    rope = LlamaRotaryEmbedding(config)
    d = config.hidden_size // config.num_attention_heads
    L, m, kept = 300, 5, [0, 137, 299]
    p = len(kept)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, L, d)

    def at(x, pos):  # x [1, 1, T, d] rotated to positions pos
        cos, sin = rope(x, torch.tensor([pos]))
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    keys = at(k, list(range(L)))
    moved = select_kv([keys], [torch.zeros_like(keys)], torch.tensor([[kept]]), model_dir)[0][0]
    for i, j in enumerate(kept):
        teacher = (at(q, [L + m])[0, 0, 0] * keys[0, 0, j]).sum()
        student = (at(q, [p + m])[0, 0, 0] * moved[0, 0, i]).sum()
        assert student.item() == pytest.approx(teacher.item(), rel=1e-4, abs=1e-4)


def test_selecting_every_position_gives_the_documents_own_kv_and_mass_is_attention(inference, student):
    tok = inference.tokenizer
    doc = document_ids(tok, DOC_A)
    rows = [continuation_ids(tok, [{"role": "user", "content": q}]) for q in ("Who keeps the light?", "When?")]
    mass = attention_mass(student, doc, rows)
    cfg = student.model.config
    assert mass.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, len(doc)) and (mass >= 0).all()
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    # each row token's probabilities over document + its own row sum to 1 per query head
    assert (mass.sum(-1) <= group * sum(map(len, rows)) + 1e-6).all()
    assert student.model.config._attn_implementation == "sdpa"  # put back after the eager pass
    keys, values = select_init(student, resolve_model_path(TINY), doc, rows, len(doc), 1)
    full_k, full_v = student.prefill(doc)
    assert all(torch.allclose(a, b) for a, b in zip(keys + values, full_k + full_v))


@pytest.mark.parametrize("init", ["select", "match"])
def test_distill_from_a_selected_cartridge_records_its_questions_once(inference, tmp_path, init):
    out, kw = tmp_path / "s.pt", dict(init=init, init_questions=3)
    first = run_distill(inference, out, steps=1, **kw)
    assert len(first[0]["questions"]) == 3 + 2 and first[0]["init_s"] > 0  # init's questions, then the step's
    resumed = run_distill(inference, out, steps=2, **kw)  # from the checkpoint: no second initialisation
    assert len(resumed) == 2 and "init_s" not in resumed[1] and len(resumed[1]["questions"]) == 2
    with pytest.raises(CartridgeError) as err:
        DistillConfig(tokens=8, init="random").check()
    assert err.value.field == "init"
