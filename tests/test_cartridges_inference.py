"""Cartridges through the public surface: InferenceEngine, config, CLI (the document is never prefilled)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cartridges_helpers import documents
from conftest import tiny_config
from final.cartridges.build import build_from_text, document_ids
from final.cartridges.format import save_cartridge
from final.errors import CartridgeError
from final.inf import InferenceEngine

DOC = "The lighthouse keeper of Orvanis is called Mara Quill. She keeps three cats named Pip, Jot and Fennel."


@pytest.fixture(scope="module")
def cart_file(tmp_path_factory, tiny_dir):
    """A cartridge of DOC built on the tiny model and saved as a .pt (cartridges-repo layout)."""
    with InferenceEngine(tiny_config(prompt_length=256)) as eng:
        ids = document_ids(eng.tokenizer, DOC)
        cart = build_from_text(eng.engine, ids)
    path = tmp_path_factory.mktemp("carts") / "doc.pt"
    save_cartridge(cart, path)
    return path


def test_cartridge_equals_document_in_the_prompt(cart_file):
    with InferenceEngine(tiny_config(prompt_length=256)) as eng:
        cid = eng.load_cartridge(path=str(cart_file))
        question = "Who keeps the lighthouse?"
        with_cart = eng.generate(question, cartridge=cid, temperature=0, max_tokens=12)
        in_prompt = eng.generate([{"role": "system", "content": DOC}, {"role": "user", "content": question}],
                                 temperature=0, max_tokens=12)
        assert with_cart.token_ids == in_prompt.token_ids
        # the cartridge replaced the document: its tokens count as cached prompt tokens (OpenAI's usage), and the
        # whole context is as long as the document in the prompt
        meta = with_cart.metadata[0]
        assert meta["cached_tokens"] > 20 and in_prompt.metadata[0]["cached_tokens"] == 0
        assert meta["prompt_tokens"] == in_prompt.metadata[0]["prompt_tokens"]
        # several prompts, one with and one without; composition in request order
        mixed = eng.generate([question, question], cartridge=[cid, None], temperature=0, max_tokens=12)
        plain = eng.generate(question, temperature=0, max_tokens=12)
        assert mixed.token_ids == [with_cart.token_ids[0], plain.token_ids[0]]
        assert eng.generate(question, cartridge=[cid, cid], max_tokens=4).completions  # composed A+A runs
        with pytest.raises(CartridgeError, match="unknown cartridge"):
            eng.generate(question, cartridge="nope")
        assert eng.unload_cartridge(cid) is True
        with pytest.raises(CartridgeError):
            eng.generate(question, cartridge=cid)
        assert eng.generate(question, temperature=0, max_tokens=12).token_ids == plain.token_ids


def test_config_cartridges_load_at_start(cart_file):
    cfg = tiny_config(prompt_length=256)
    cfg["cartridges"] = [{"id": "lighthouse", "source": "local", "path": str(cart_file)}]
    with InferenceEngine(cfg) as eng:
        assert eng.cartridges.ids() == ["lighthouse"]
        assert eng.generate("Who?", cartridge="lighthouse", max_tokens=3).completions


def test_cli_generate_with_a_cartridge_file(cart_file):
    res = subprocess.run([sys.executable, "-m", "final.cli", "generate", "--model", "builtin:tiny-random-llama",
                          "--cartridge", str(cart_file), "--max-tokens", "4", "Who keeps the lighthouse?"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr and res.stdout.strip()


@pytest.mark.slow
def test_smollm2_answers_from_the_cartridge(tmp_path):
    text, questions = documents()["lighthouse.txt"]
    with InferenceEngine("config.yaml") as eng:
        cart = build_from_text(eng.engine, document_ids(eng.tokenizer, text))
        save_cartridge(cart, tmp_path / "lighthouse.pt")
        cid = eng.load_cartridge(path=str(tmp_path / "lighthouse.pt"))
        for q in questions:
            ours = eng.generate(q, cartridge=cid, temperature=0, max_tokens=24).completions[0]
            ref = eng.generate([{"role": "system", "content": text}, {"role": "user", "content": q}],
                               temperature=0, max_tokens=24).completions[0]
            assert ours == ref
