"""Fact rows: training rows made from the document's own sentences, so every fact is asked about.

A question writer (self-study: the model writes its own questions) asks about a few salient facts, and a 135M model
writes vague or invented ones: a cartridge trained on them learns the teacher's style of answer, not the facts
(bench/RESULTS.md, "Trained cartridges"). Here nothing is generated: per sentence of the document (sentences.py),
  - quote rows: a question naming one of the sentence's cues (names, numbers; templates below) answered by the
    sentence and the next `quote_sentences - 1` verbatim;
  - cloze rows: the sentence with one cue blanked out, answered by the cue (a short answer, as a user's factual
    question gets);
and the teacher (final/training/teacher.py: the model with the document as its system turn, or with the
`teacher_tokens` window of the document around the sentence) scores every token after the system turn (its top-k
logprobs). Every sentence gets rows, so the cartridge is taught the whole document, not the parts a question
writer happens to pick.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from final.training.rows import Conversation, append
from final.training.document.sentences import (MARKER, TITLES, code_spans, table_headers, unwrap,
                                                unwrapped_sentences)
from final.training.settings import FactConfig
from final.training.teacher import by_teacher, teacher_system, teacher_window, token_offsets, token_range
from final.errors import CartridgeError
from final.prompts import continuation_ids

QUOTE = ("What does the document say about {cue}?", "Tell me about {cue}.", "What do we know about {cue}?",
         "What is said about {cue} in the document?")
CLOZE = ('Fill in the blank from the document: "{blanked}"',
         'According to the document, what goes in the blank? "{blanked}"')
_SPACES = re.compile(r"(?<=\S) {2,}(?=\S)")
_WORDY = re.compile(r"[^\W_]")  # a blank needs words around it: "## ___" (a heading blanked) asks nothing
NUMBER_WORDS = ("one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|"
                "sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|"
                "hundred|thousand|half|quarter|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth")
# A name's word: a capitalised word, or a title or initials with their periods before the rest of the name ("Dr. Hesper
# Lund", "J. R. Ailes", "U.S. Navy": split at the period, "Dr" would be a cue of its own and the name another).
_NAME_WORD = rf"(?:(?:{'|'.join(sorted(TITLES))}|[A-Z](?:\.[A-Z])*)\.(?=\s+[A-Z])|[A-Z][\w'-]*)"
# A cue: a run of capitalised words (joined by of/the/de/and), a number with its inner separators, or a number
# written as words ("eleven households").
_CUE = re.compile(rf"{_NAME_WORD}(?:\s+(?:(?:of|the|de|and)\s+)?{_NAME_WORD})*|\d(?:[\d,.:/-]*\d)?|"
                  rf"\b(?:{NUMBER_WORDS})(?:[ -](?:{NUMBER_WORDS}))*\b")
# Capitalised only because a sentence starts with them: never a cue on their own.
_FUNCTION = frozenset("a an and as at by for from in it its on the their there these this those to when where "
                      "which while with after before during since until each every all some most many".split())


@dataclass
class FactPrompt:
    kind: str
    question: str
    answer: str
    span: tuple[int, int]  # the characters of the document the row is about (the teacher's window centres on it)


def names(text: str) -> frozenset[str]:
    """Capitalised words the document uses inside a sentence: the names a sentence's first word may be."""
    return frozenset(m.group(1) for m in re.finditer(r"(?<=[a-z,;] )([A-Z][\w'-]*)", text))


def cues(sentence: str, known: frozenset[str] = frozenset()) -> list[str]:
    """The names and numbers a question about this sentence can name, in order, each once. The sentence's first
    word counts only as part of a longer name or where `known` (names()) has it: "Today", "During" are not names."""
    out = []
    for m in _CUE.finditer(sentence):
        words = m.group(0).split()
        while words and words[0].lower() in _FUNCTION:  # "The Sallow River" -> "Sallow River"; "It" -> nothing
            words = words[1:]
        if m.start() == 0 and len(words) == 1 and words[0] not in known:
            continue
        cue = " ".join(words).rstrip(".,:")
        if cue and cue not in out:
            out.append(cue)
    return out


def fact_prompts(text: str, cfg: FactConfig) -> list[FactPrompt]:
    """Per sentence, in document order: up to `cues` quote rows, then one cloze row per cue."""
    rng = random.Random(cfg.seed)
    text = unwrap(text)  # a hard wrap is a space in questions and answers (the spans are the document's)
    spans = unwrapped_sentences(text)
    known = names(text)
    headers = table_headers(text)
    code = code_spans(text)
    out = []
    for i, (lo, hi) in enumerate(spans):
        sentence = text[lo:hi]
        found = cues(sentence, known)
        # a table's row is quoted and blanked under its header, which names its cells, and alone: the next row is
        # another record; any other sentence is quoted with the ones after it
        header = headers.get(lo)
        lead = text[header[0]:header[1]] + "\n" if header else ""
        marker = MARKER.match(sentence)
        opening = marker.end() if marker else 0  # where the words start, past "- " or "4. "
        end = hi if header else _quote_end(spans, i, cfg.quote_sentences, code)
        # a sentence without names or numbers is still quoted, asked about by its opening words
        for cue in found[:cfg.cues] or [" ".join(sentence[opening:].split()[:5]).rstrip(".,:;")]:
            out.append(FactPrompt("quote", rng.choice(QUOTE).format(cue=cue), lead + text[lo:end], (lo, end)))
        # a cue at 0 is the sentence's subject (after an item's "- ", its key: "- Crossing time: 35 minutes" asks
        # for 35): blanking it leaves nothing to ask from; a blank needs words around it ("## ___" asks nothing)
        for at, cue in [(sentence.find(cue), cue) for cue in found if sentence.find(cue) > opening]:
            if _WORDY.search(sentence[:at] + sentence[at + len(cue):]):
                blanked = lead + sentence[:at] + "___" + sentence[at + len(cue):]
                out.append(FactPrompt("cloze", rng.choice(CLOZE).format(blanked=blanked), cue, (lo, hi)))
    # unwrap pads a word joined across a hyphen's wrap with the break's spaces ("red-brick  mill"): one is a space
    return [FactPrompt(p.kind, _SPACES.sub(" ", p.question), _SPACES.sub(" ", p.answer), p.span) for p in out]


def _quote_end(spans: list[tuple[int, int]], i: int, count: int, code: list[tuple[int, int]]) -> int:
    """Where a quote of sentence i and the ones after it, `count` in all, ends: at the last of them, or before the
    first that a code block separates from the one before it (a quote is prose)."""
    end = spans[i][1]
    for lo, hi in spans[i + 1:i + count]:
        if any(end <= a < lo for a, _ in code):
            break
        end = hi
    return end


def fact_rows(inference: Any, text: str, cfg: FactConfig, batch: int = 16) -> list[Conversation]:
    """The fact prompts scored by the teacher: every token after the system turn gets its top-k (the question's
    names are targets too). The answer ends with the end-of-turn token, so the cartridge also learns where an
    answer stops."""
    cfg.check()
    prompts = fact_prompts(text, cfg)
    if not prompts:
        raise CartridgeError("the document has no sentences to ask about", field="text")
    tok = inference.tokenizer
    offsets = token_offsets(tok, text)
    end = end_of_turn(tok)
    rows: list[Conversation | None] = [None] * len(prompts)
    for ctx, ids in by_teacher(inference, teacher_systems(tok, text, prompts, cfg, offsets), f"__facts-{cfg.seed}"):
        for b in range(0, len(ids), batch):
            part = ids[b:b + batch]
            asked, answers = map(list, zip(*(prompt_ids(tok, prompts[i], end) for i in part)))
            for i, q, a, (tops, _) in zip(part, asked, answers, ctx.teacher_scores(asked, answers, cfg.top_k)):
                fp = prompts[i]
                rows[i] = Conversation(i, q, a, [[t for t, _ in top] for top in tops],
                                       [[lp for _, lp in top] for top in tops], fp.kind, fp.question,
                                       fp.answer, token_range(offsets, fp.span), 1)
    return [r for r in rows if r is not None]


def teacher_systems(tok: Any, text: str, prompts: Sequence[FactPrompt], cfg: FactConfig,
                    offsets: list[tuple[int, int]]) -> list[str]:
    """Each fact prompt's teacher, as its system turn: the whole document, or the cfg.teacher_tokens window of it
    around the prompt's sentence (offsets: token_offsets(tok, text))."""
    if not cfg.teacher_tokens:
        return [teacher_system(text)] * len(prompts)
    return [teacher_window(tok, text, fp.span, cfg.teacher_tokens, offsets) for fp in prompts]


def prompt_ids(tok: Any, fp: FactPrompt, end: int) -> tuple[list[int], list[int]]:
    """A fact row's token stream after the cartridge: the question as a user turn, then the answer closed by
    `end` (end_of_turn), so the row also teaches where an answer stops."""
    return (continuation_ids(tok, [{"role": "user", "content": fp.question}]),
            tok(fp.answer, add_special_tokens=False).input_ids + [end])


def end_of_turn(tok: Any) -> int:
    """The token that closes an assistant turn (a row's answer ends with it, so an answer learns to stop)."""
    return tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id


def write_fact_rows(inference: Any, text: str, out: str | Path, cfg: FactConfig) -> int:
    """fact_rows appended to the JSONL `out` (read by `final cartridge train`); returns how many."""
    rows = fact_rows(inference, text, cfg)
    append(Path(out), rows)
    return len(rows)
