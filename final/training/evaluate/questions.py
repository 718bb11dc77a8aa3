"""Question sets that judge a cartridge by what users ask (data/qa/*.jsonl): a document NAME.txt and, beside it,
NAME.jsonl with one question a line:

  {"id": "brennock-01", "split": "tune", "question": "...", "choices": ["...", "...", "...", "..."],
   "answer": 2, "reference": "...", "support": "..."}

- `choices`: the multiple-choice options (2 or more, distinct), `answer` the index of the right one; each option is
  scored as the assistant's answer by log-likelihood (final.training.evaluate.accuracy);
- `reference`: the short open answer a greedy generation must contain;
- `support`: a verbatim span of the document that answers the question (checked here: it must occur in the
  document exactly once, whitespace aside - a hard-wrapped document breaks it over lines; its place gives
  `position`, so a set shows it covers the whole document);
- `split`: "tune" (may be looked at while choosing methods and settings) or "test" (held back until the end).
A problem names the file, the line and the field (CartridgeError).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from final.cartridges.build import read_utf8
from final.errors import CartridgeError
from final.training.rows import jsonl_objects

SPLITS = ("tune", "test")
FIELDS = ("id", "split", "question", "choices", "answer", "reference", "support")


@dataclass(frozen=True)
class Question:
    id: str
    split: str
    question: str
    choices: tuple[str, ...]
    answer: int
    reference: str
    support: str
    position: float  # where the support starts, as a fraction of the document's characters


@dataclass(frozen=True)
class QASet:
    name: str
    document: str
    questions: tuple[Question, ...]


def load_qa(path: str | Path, split: str | None = None, document: str | Path | None = None) -> QASet:
    """Read NAME.jsonl and its document (NAME.txt beside it unless `document` names one); `split`: only that
    half ("tune" or "test"; None: both)."""
    path = Path(path)
    name = str(path)
    if split is not None and split not in SPLITS:
        raise CartridgeError(f"must be one of {list(SPLITS)}, got {split!r}", field="split")
    doc_path = Path(document) if document is not None else path.with_suffix(".txt")
    for p, field in ((path, "qa"), (doc_path, "document")):
        if not p.is_file():
            raise CartridgeError("file does not exist", file=str(p), field=field)
    text = read_utf8(doc_path, "document")
    questions: list[Question] = []
    seen: set[str] = set()
    for n, obj in jsonl_objects(path, "qa"):
        q = _question(obj, n, name, text)
        if q.id in seen:
            raise CartridgeError(f"line {n}: id {q.id!r} appears twice", file=name, field="id")
        seen.add(q.id)
        questions.append(q)
    if not questions:
        raise CartridgeError("has no questions", file=name, field="qa")
    return QASet(path.stem, text, tuple(q for q in questions if split is None or q.split == split))


def _question(obj: object, n: int, name: str, text: str) -> Question:
    def bad(field: str, why: str) -> CartridgeError:
        return CartridgeError(f"line {n}: {why}", file=name, field=field)

    if not isinstance(obj, dict):
        raise CartridgeError(f"line {n} is not a JSON object", file=name, field=f"line {n}")
    for key in FIELDS:
        if key not in obj:
            raise bad(key, f"lacks {key!r}")
    for key in ("id", "question", "reference", "support"):
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise bad(key, "must be a non-empty string")
    if obj["split"] not in SPLITS:
        raise bad("split", f"must be one of {list(SPLITS)}, got {obj['split']!r}")
    choices = obj["choices"]
    if (not isinstance(choices, list) or len(choices) < 2 or len(set(map(str, choices))) != len(choices)
            or not all(isinstance(c, str) and c.strip() for c in choices)):
        raise bad("choices", "must be a list of at least 2 distinct non-empty strings")
    answer = obj["answer"]
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise bad("answer", f"must be an index into choices, in [0, {len(choices)}), got {answer!r}")
    found = support_spans(text, obj["support"])
    if len(found) != 1:
        raise bad("support", f"must occur in the document exactly once, found {len(found)} times")
    return Question(obj["id"], obj["split"], obj["question"], tuple(choices), answer, obj["reference"],
                    obj["support"], found[0][0] / max(len(text), 1))


def support_spans(text: str, support: str) -> list[tuple[int, int]]:
    """Where `support` occurs in `text`, as [start, end) character spans, any run of whitespace matching any other:
    a support copied from a hard-wrapped document's rendering ("Sallow River") is its "Sallow\\nRiver", and a
    hyphen may be a wrap's ("red-\\nbrick")."""
    pattern = r"\s+".join(re.escape(word).replace(r"\-", r"-\s*") for word in support.split())  # "red-\nbrick"
    return [m.span() for m in re.finditer(pattern, text)] if pattern else []
