"""Fixtures and texts the training tests share (final/training): the tiny engine, a short document, its fact rows,
the tiny student. Imported by name into a test module, which then holds them for its own module scope."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cartridges_helpers import TINY
from serve_helpers import DOC_A
from final.inf import local_engine
from final.models import resolve_model_path
from final.training.document.facts import write_fact_rows
from final.training.settings import FactConfig
from final.training.student import Student

DOC = ("Brennock Ferry is a small town on the Sallow River. It was founded in 1742 by Odo Brennock.\n"
       "Today the town has roughly 6,300 people. The first settlement had eleven households.\n\n"
       "The mill closed in 1903! Was it rebuilt? Nobody knows.")


@pytest.fixture(scope="module")
def inference():
    engine = local_engine(TINY, dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def data(inference, tmp_path_factory):
    """DOC_A's fact rows (the teacher's top 5 per target), as `learn` writes them."""
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    assert write_fact_rows(inference, DOC_A, path, FactConfig(top_k=5)) >= 4
    return path


@pytest.fixture(scope="module")
def student():
    return Student(resolve_model_path(TINY))


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_path(TINY))


def settings(tmp_path: Path, text: str) -> list[str]:
    """`--settings FILE` for a command line: `text` (YAML) written to a file of its own under tmp_path."""
    path = tmp_path / f"settings-{abs(hash(text))}.yaml"
    path.write_text(text)
    return ["--settings", str(path)]
