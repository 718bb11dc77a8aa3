"""Does a cartridge know its document? Accuracy on questions users ask (final.training.evaluate.questions), beside KL.

For each condition - no document (the plain chat), the document's first p tokens, its first k*p tokens, the whole
document (in context: the ceiling), the cartridge and, when asked (`chunk_tokens`), the relevant chunk alone (each
question after its own window of the document around its support span: what a long document's reader would see
if it were handed the right passage) - every question is asked as a user asks it, after the condition's prefix (the
teacher's system turn, final.training.teacher.teacher_ids, of the document cut, whole or chunked; or the
cartridge):
- multiple choice, as lm-eval scores it: each option as the assistant's answer, by the sum of its tokens'
  log-likelihoods; `acc` takes the highest sum, `acc_norm` the highest sum per character of the option (choose);
- open answer: a greedy generation of `open_tokens` tokens must contain the reference (`contains`; `exact`: the
  whole answer is the reference, case, spacing and punctuation aside);
- KL(whole document || condition) per token of the right option, the teacher being the whole document in context.
Each figure comes with a 95% interval: Wilson's for the shares, the normal one for the mean KL.
Forwards are the engine's serving forward after a loaded prefix, so what is measured is what is served.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from final.cartridges.build import build_from_text
from final.cartridges.format import CartridgeKV
from final.compat import chat_ids
from final.errors import CartridgeError
from final.prompts import continuation_ids
from final.training.evaluate.questions import Question, support_spans
from final.training.teacher import teacher_ids, teacher_window, token_offsets

WHOLE = "whole document"
MULTIPLE = 8  # the first-k*p-tokens row: what a prefix 8x the cartridge's bytes answers
CHUNK = "relevant chunk"


@dataclass
class QARow:
    condition: str
    prefix_tokens: int
    questions: int
    acc: float
    acc_ci: tuple[float, float]
    acc_norm: float
    acc_norm_ci: tuple[float, float]
    contains: float
    contains_ci: tuple[float, float]
    exact: float
    kl: float  # mean KL(whole document || condition) per token of the right option, nats
    kl_ci: tuple[float, float]
    kv_bytes: int  # the relevant-chunk row: prefix tokens and KV bytes are the mean over its questions' chunks
    right: tuple[str, ...] = ()  # the ids of the questions `acc` counts right (a JSON report can be broken down)


def kl_and_top1(teacher: torch.Tensor, student: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position KL(teacher || student) and argmax agreement, from logits [N, V]."""
    t, s = F.log_softmax(teacher.float(), -1), F.log_softmax(student.float(), -1)
    return (t.exp() * (t - s)).sum(-1), (t.argmax(-1) == s.argmax(-1)).float()


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% score interval of a share k/n (sound at small n and at 0 or n, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (mid - half) / (1 + z * z / n)), min(1.0, (mid + half) / (1 + z * z / n))


def mean_ci(xs: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    n = len(xs)
    if n < 2:
        return (xs[0], xs[0]) if xs else (0.0, 0.0)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m - z * sd / math.sqrt(n), m + z * sd / math.sqrt(n)


def normalise(text: str) -> str:
    text = re.sub(r"(?<=\d),(?=\d)", "", text.lower())
    return " ".join(re.sub(r"[^a-z0-9.\- ]+", " ", text).split()).strip(" .")


def conditions(engine: Any, tokenizer: Any, text: str, cart: CartridgeKV | None, p: int | None,
               multiple: int) -> list[tuple[str, CartridgeKV | None]]:
    """(name, prefix) in table order; the first-p and first-k*p rows only where shorter than the document."""
    ids = teacher_ids(tokenizer, text)
    full = build_from_text(engine, ids)
    p = cart.num_tokens if cart is not None else p
    out: list[tuple[str, CartridgeKV | None]] = [("no document", None)]
    for n in dict.fromkeys(x for x in (p, (p or 0) * multiple) if x):
        if n < len(ids):
            out.append((f"first {n} tokens", CartridgeKV([k[:, :, :n] for k in full.keys],
                                                         [v[:, :, :n] for v in full.values], 1)))
    out.append((WHOLE, full))
    if cart is not None:
        out.append(("cartridge", CartridgeKV([k.to(full.dtype) for k in cart.keys],
                                             [v.to(full.dtype) for v in cart.values], cart.num_frozen_tokens)))
    return out


def qa_evaluate(inference: Any, text: str, questions: Sequence[Question], cart: CartridgeKV | None = None, *,
                p: int | None = None, multiple: int = MULTIPLE, open_tokens: int = 32,
                chunk_tokens: int | None = None) -> list[QARow]:
    """One row per condition (conditions()); `cart` (served convention) or `p` sets the first-p rows;
    `chunk_tokens`: add the relevant-chunk row (relevant_chunks()), last."""
    if not questions:
        raise CartridgeError("no questions to ask", field="qa")
    if cart is None and p is None:
        raise CartridgeError("give a cartridge or p", field="tokens")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise CartridgeError(f"must be at least 1, got {chunk_tokens}", field="chunk_tokens")
    engine, tok = inference.engine, inference.tokenizer
    chunks = relevant_chunks(tok, text, questions, chunk_tokens) if chunk_tokens is not None else None
    conds = conditions(engine, tok, text, cart, p, multiple)
    scored = {name: _ask_after(inference, kv, questions, open_tokens) for name, kv in conds}
    teacher = [logits for _, _, _, logits in scored[WHOLE]]
    rows = [row(name, *_size(kv), scored[name], teacher, questions) for name, kv in conds]
    if chunks is not None:  # each question after its own chunk: one prefix a question, built when asked
        got, sizes = [], []
        for chunk, q in zip(chunks, questions):
            kv = build_from_text(engine, teacher_ids(tok, chunk))
            got.append(_ask_after(inference, kv, [q], open_tokens)[0])
            sizes.append(_size(kv))
        rows.append(row(CHUNK, *(round(sum(x) / len(x)) for x in zip(*sizes)), got, teacher, questions))
    return rows


def relevant_chunks(tokenizer: Any, text: str, questions: Sequence[Question], tokens: int) -> list[str]:
    """Per question, the window of `tokens` document tokens centred on its support span: shifted, not shrunk, where
    it would pass the document's start or end, and the whole support even where that is longer. A fixed window
    rather than the support's paragraph: every question gets the same amount of context whatever its paragraph's
    length (skarrow's run from ~20 to ~230 tokens), the size of the chunks a long document's cartridge is taught
    from, and no paragraph markup is needed. The chunk is the document's own text (character offsets), so a
    window as long as the document is the document."""
    offsets = token_offsets(tokenizer, text)
    out = []
    for q in questions:
        found = support_spans(text, q.support)
        if not found:
            raise CartridgeError(f"question {q.id!r}: support not in the document", field="support")
        out.append(teacher_window(tokenizer, text, found[0], tokens, offsets))
    return out


def _ask_after(inference: Any, kv: CartridgeKV | None, questions: Sequence[Question],
               open_tokens: int) -> list[tuple[bool, bool, str, torch.Tensor]]:
    """ask() after `kv` served as a temporary cartridge (None: the plain chat)."""
    cid = f"__qa-{uuid.uuid4().hex[:8]}" if kv is not None else None
    if kv is not None:
        inference.cartridges.add(cid, kv)
    try:
        return ask(inference, questions, (cid,) if cid is not None else (), open_tokens)
    finally:
        if cid is not None:
            inference.unload_cartridge(cid)


def _size(kv: CartridgeKV | None) -> tuple[int, int]:
    return (kv.num_tokens, kv.nbytes) if kv is not None else (0, 0)


def ask(inference: Any, questions: Sequence[Question], cartridges: tuple[str, ...],
        open_tokens: int) -> list[tuple[bool, bool, str, torch.Tensor]]:
    """Per question: (acc hit, acc_norm hit, greedy answer, logits over the right option's tokens), after the
    loaded `cartridges` composed in order (none: the plain chat) - the prefix the engine serves a request
    naming them (PrefixTable.get), and generate(cartridge=[...]) for the open answers."""
    engine, tok = inference.engine, inference.tokenizer
    prefix = engine.prefixes.get(tuple(cartridges))
    prompts = []
    for q in questions:
        user = [{"role": "user", "content": q.question}]
        prompts.append(continuation_ids(tok, user) if cartridges else
                       chat_ids(tok, user, add_generation_prompt=True))
    out = []
    for q, prompt in zip(questions, prompts):
        sums, right = [], None
        for i, choice in enumerate(q.choices):
            cids = tok(choice, add_special_tokens=False).input_ids
            logits, _ = engine.call(lambda runner, ids=prompt + cids: runner.forward_full(ids, prefix))
            logits = logits[len(prompt) - 1:len(prompt) - 1 + len(cids)].float()
            lp = float(torch.log_softmax(logits, -1).gather(1, torch.tensor(cids)[:, None]).sum())
            sums.append(lp)
            if i == q.answer:
                right = logits
        acc, norm = choose(sums, q.choices)
        out.append([acc == q.answer, norm == q.answer, "", right])
    gen = inference.generate(prompts, cartridge=list(cartridges) or None, temperature=0.0, max_tokens=open_tokens)
    for got, text in zip(out, gen.completions):
        got[2] = text
    return [tuple(got) for got in out]


def choose(loglikelihoods: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """The options `acc` and `acc_norm` pick, as lm-eval 0.4.13 does for a multiple-choice task (api/task.py,
    process_results): the highest log-likelihood, and the highest log-likelihood per character of the option
    (`completion_len = len(choice)`; its `acc_bytes` divides by UTF-8 bytes instead); the first on a tie, as
    np.argmax. Per character, an option with accents or CJK weighs as its letters, not as its bytes."""
    norms = [lp / len(choice) for lp, choice in zip(loglikelihoods, choices)]
    return _argmax(loglikelihoods), _argmax(norms)


def _argmax(xs: Sequence[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def row(name: str, prefix_tokens: int, kv_bytes: int, got: list, teacher: list[torch.Tensor],
        questions: Sequence[Question]) -> QARow:
    """A condition's figures from ask()'s answers; KL to `teacher` (the logits ask() gave under the teacher)."""
    n = len(got)
    acc, norm = sum(g[0] for g in got), sum(g[1] for g in got)
    contains = sum(normalise(q.reference) in normalise(g[2]) for q, g in zip(questions, got))
    exact = sum(normalise(q.reference) == normalise(g[2]) for q, g in zip(questions, got))
    kls = [float(kl_and_top1(t, g[3])[0].mean()) for t, g in zip(teacher, got)]
    return QARow(name, prefix_tokens, n, acc / n, wilson(acc, n), norm / n, wilson(norm, n), contains / n,
                 wilson(contains, n), exact / n, sum(kls) / n, mean_ci(kls), kv_bytes,
                 tuple(q.id for q, g in zip(questions, got) if g[0]))


def table(rows: Sequence[QARow]) -> str:
    """A markdown table, 95% intervals in brackets."""
    def share(x: float, ci: tuple[float, float]) -> str:
        return f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"

    lines = ["| condition | prefix tokens | MC acc | MC acc_norm | open: contains | open: exact | KL to whole "
             "document (nats/token) | KV bytes |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.condition} | {r.prefix_tokens} | {share(r.acc, r.acc_ci)} | {share(r.acc_norm, r.acc_norm_ci)} "
              f"| {share(r.contains, r.contains_ci)} | {r.exact:.2f} | {r.kl:.3f} [{r.kl_ci[0]:.3f}, "
              f"{r.kl_ci[1]:.3f}] | {r.kv_bytes:,} |" for r in rows]
    return "\n".join(lines)
