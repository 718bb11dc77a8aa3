"""The rows a cartridge is trained on, on disk: one JSON object a line, written by `learn` (fact rows) and `traces`
(tool-use rows), read by `train` and `learn`; the on-policy loop makes them in memory.

A row is what distillation needs and nothing it must re-derive: the student's token stream after the cartridge
(`prompt_ids` then `answer_ids`, no BOS: final.prompts.continuation_ids), and for every supervised token the
teacher's top-k (ids, logprobs) at the position that predicts it. Supervised tokens run from `target_start` (an
index into prompt_ids + answer_ids) to the end, as the cartridges repo supervises every token after the system
prompt (its teacher logprobs start at the first message, its mask is all true). Token 0 is never a target: it is
predicted by the cartridge's last position, which is KV and has no logits. `mask` (optional, one 0/1 per
target) drops targets from the loss, e.g. a tool's response in a tool-use trace. Rows without `target_start` (files
of earlier versions) supervise the answer only. A hard target is a one-hot teacher: top-1 with logprob 0.
Text fields (seed type, question, answer, chunk window) are kept for people reading the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

from final.cartridges.build import read_utf8
from final.errors import CartridgeError

T = TypeVar("T")
REQUIRED = ("id", "prompt_ids", "answer_ids", "top_ids", "top_logprobs")


@dataclass
class Conversation:
    id: int
    prompt_ids: list[int]
    answer_ids: list[int]
    top_ids: list[list[int]]  # per target token: the teacher's k most likely ids, most likely first
    top_logprobs: list[list[float]]
    seed_type: str = ""
    question: str = ""
    answer: str = ""
    chunk: tuple[int, int] = (0, 0)  # the document's token window the teacher saw
    target_start: int | None = None  # None: the answer's first token (len(prompt_ids))
    mask: list[int] | None = field(default=None)  # per target: 1 = in the loss (None: all)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids

    @property
    def first_target(self) -> int:
        return len(self.prompt_ids) if self.target_start is None else self.target_start

    def answer_targets(self) -> slice:
        """The slice of top_ids / top_logprobs that belongs to the answer's tokens."""
        return slice(len(self.prompt_ids) - self.first_target, None)

    def to_json(self) -> str:
        row = {k: v for k, v in asdict(self).items() if v is not None}
        row["top_logprobs"] = [[round(x, 5) for x in xs] for xs in self.top_logprobs]
        return json.dumps(row, ensure_ascii=False)


def _cut_torn_tail(path: Path) -> None:
    """A run killed mid-write leaves a last line without its newline: cut it, so that the next append starts a
    line of its own (appending onto it would glue two rows into one unreadable line). Its row is written again:
    done_ids never counted it."""
    with open(path, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return
        block, end = 1 << 16, size
        while end > 0:
            start = max(0, end - block)
            fh.seek(start)
            chunk = fh.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                fh.truncate(start + cut + 1)
                return
            end = start
        fh.truncate(0)


def append(path: Path, rows: Iterable[Conversation]) -> None:
    """Append rows and flush them to disk, so a killed run keeps every finished batch."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        _cut_torn_tail(path)
    with open(path, "a") as fh:
        for row in rows:
            fh.write(row.to_json() + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def jsonl_objects(path: Path, field: str = "data") -> Iterator[tuple[int, object]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; a line that is not JSON is a
    CartridgeError naming the file and the line (the rule of every JSONL file final reads for training)."""
    for n, line in enumerate(read_utf8(path, field).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise CartridgeError(f"line {n} is not JSON: {exc}", file=str(path), field=f"line {n}") from None


def read_conversations(path: str | Path, vocab_size: int) -> list[Conversation]:
    """Parse and check every row; a problem names the file, the line and the field."""
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise CartridgeError("conversation file does not exist", file=name, field="data")
    rows = [_row(obj, n, name, vocab_size) for n, obj in jsonl_objects(path)]
    if not rows:
        raise CartridgeError("has no conversations", file=name, field="data")
    return rows


def _ids(value: object, key: str, n: int, name: str, vocab: int) -> list[int]:
    ok = isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)
    if not ok:
        raise CartridgeError(f"line {n}: must be a non-empty list of token ids in [0, {vocab})", file=name, field=key)
    return value


def _row(obj: object, n: int, name: str, vocab: int) -> Conversation:
    if not isinstance(obj, dict):
        raise CartridgeError(f"line {n} is not a JSON object", file=name, field=f"line {n}")
    for key in REQUIRED:
        if key not in obj:
            raise CartridgeError(f"line {n} lacks {key!r}", file=name, field=key)
    prompt, answer = _ids(obj["prompt_ids"], "prompt_ids", n, name, vocab), _ids(obj["answer_ids"], "answer_ids", n,
                                                                                    name, vocab)
    start = obj.get("target_start", len(prompt))
    if not isinstance(start, int) or isinstance(start, bool) or not 1 <= start <= len(prompt):
        raise CartridgeError(f"line {n}: must be an integer in [1, {len(prompt)}] (token 0 has no predicting "
                             "position after a cartridge)", file=name, field="target_start")
    targets = len(prompt) + len(answer) - start
    tops, lps = obj["top_ids"], obj["top_logprobs"]
    if not isinstance(tops, list) or not isinstance(lps, list) or not (len(tops) == len(lps) == targets):
        raise CartridgeError(f"line {n}: top_ids and top_logprobs need one entry per target token ({targets})",
                             file=name, field="top_ids")
    k = len(tops[0]) if tops and isinstance(tops[0], list) else 0
    for t, lp in zip(tops, lps):
        _ids(t, "top_ids", n, name, vocab)
        if len(t) != k or not isinstance(lp, list) or len(lp) != k or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 for x in lp):
            raise CartridgeError(f"line {n}: every position needs {k} ids and {k} logprobs <= 0", file=name,
                                 field="top_logprobs")
    mask = obj.get("mask")
    if mask is not None and (not isinstance(mask, list) or len(mask) != targets or any(m not in (0, 1) for m in mask)
                             or not any(mask)):
        raise CartridgeError(f"line {n}: must be {targets} values of 0 or 1, at least one 1", file=name, field="mask")
    return Conversation(int(obj["id"]), prompt, answer, tops, [[float(x) for x in lp] for lp in lps],
                        str(obj.get("seed_type", "")), str(obj.get("question", "")), str(obj.get("answer", "")),
                        tuple(obj.get("chunk", (0, 0))), obj.get("target_start"), mask)


def question_key(question: str) -> str:
    """A question as compared for duplicates: case and spacing aside."""
    return " ".join(question.lower().split())


def first_of_each_question(items: Iterable[T], question: Callable[[T], str], seen: Iterable[str] = ()) -> list[T]:
    """`items` whose question (case and spacing aside) is not among `seen`, each question once."""
    taken = {question_key(q) for q in seen}
    out = []
    for item in items:
        key = question_key(question(item))
        if key not in taken:
            taken.add(key)
            out.append(item)
    return out
