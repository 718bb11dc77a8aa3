"""Self-study conversations on disk: one JSON object a line, written by `synth`, read by `train` and `eval`.

A row is what distillation needs and nothing it must re-derive: the student's prompt ids (the conversation
rendered after the document's system turn, no BOS: final.prompts.continuation_ids), the teacher's answer ids,
and for every answer token the teacher's top-k (ids, logprobs) with the chunk in context. Text fields (seed type,
question, answer, chunk window) are kept for people reading the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from final.errors import CartridgeError

REQUIRED = ("id", "prompt_ids", "answer_ids", "top_ids", "top_logprobs")


@dataclass
class Conversation:
    id: int
    prompt_ids: list[int]
    answer_ids: list[int]
    top_ids: list[list[int]]  # per answer token: the teacher's k most likely ids, most likely first
    top_logprobs: list[list[float]]
    seed_type: str = ""
    question: str = ""
    answer: str = ""
    chunk: tuple[int, int] = (0, 0)  # the document's token window the teacher saw

    def to_json(self) -> str:
        row = asdict(self)
        row["top_logprobs"] = [[round(x, 5) for x in xs] for xs in self.top_logprobs]
        return json.dumps(row, ensure_ascii=False)


def done_ids(path: Path) -> set[int]:
    """Ids already written (a resumed synthesis skips them); a torn last line from a crash is ignored."""
    if not path.is_file():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(int(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def append(path: Path, rows: Iterable[Conversation]) -> None:
    """Append rows and flush them to disk, so a killed run keeps every finished batch."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for row in rows:
            fh.write(row.to_json() + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_conversations(path: str | Path, vocab_size: int) -> list[Conversation]:
    """Parse and check every row; a problem names the file, the line and the field."""
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise CartridgeError("conversation file does not exist", file=name, field="data")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CartridgeError(f"line {n} is not JSON: {exc}", file=name, field=f"line {n}") from None
        rows.append(_row(obj, n, name, vocab_size))
    if not rows:
        raise CartridgeError("has no conversations", file=name, field="data")
    return rows


def _row(obj: object, n: int, name: str, vocab: int) -> Conversation:
    if not isinstance(obj, dict):
        raise CartridgeError(f"line {n} is not a JSON object", file=name, field=f"line {n}")
    for key in REQUIRED:
        if key not in obj:
            raise CartridgeError(f"line {n} lacks {key!r}", file=name, field=key)

    def ids(key: str, value: object, allow_empty: bool = False) -> list[int]:
        ok = isinstance(value, list) and (allow_empty or value) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)
        if not ok:
            raise CartridgeError(f"line {n}: must be a non-empty list of token ids in [0, {vocab})", file=name,
                                 field=key)
        return value

    prompt, answer = ids("prompt_ids", obj["prompt_ids"]), ids("answer_ids", obj["answer_ids"])
    tops, lps = obj["top_ids"], obj["top_logprobs"]
    if not isinstance(tops, list) or not isinstance(lps, list) or not (len(tops) == len(lps) == len(answer)):
        raise CartridgeError(f"line {n}: top_ids and top_logprobs need one entry per answer token ({len(answer)})",
                             file=name, field="top_ids")
    k = len(tops[0]) if tops and isinstance(tops[0], list) else 0
    for t, lp in zip(tops, lps):
        ids("top_ids", t)
        if len(t) != k or not isinstance(lp, list) or len(lp) != k or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 for x in lp):
            raise CartridgeError(f"line {n}: every position needs {k} ids and {k} logprobs <= 0", file=name,
                                 field="top_logprobs")
    return Conversation(int(obj["id"]), prompt, answer, tops, [[float(x) for x in lp] for lp in lps],
                        str(obj.get("seed_type", "")), str(obj.get("question", "")), str(obj.get("answer", "")),
                        tuple(obj.get("chunk", (0, 0))))
