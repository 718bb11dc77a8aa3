"""Fact rows: training conversations made from the document's own sentences, so every fact is asked about.

Self-study's questions are written by the model itself (synth.py): a 135M model writes vague or invented questions
about a few salient facts, and a cartridge trained on them learns the teacher's style of answer, not the facts
(bench/RESULTS.md, issue 42: 0.26-0.30 MC accuracy on brennock's tune half, first 512 tokens 0.48). Here nothing is
generated: per sentence of the document,
  - quote rows: a question naming one of the sentence's cues (names, numbers; templates below) answered by the
    sentence and the next `quote_sentences - 1` verbatim;
  - cloze rows: the sentence with one cue blanked out, answered by the cue (a short answer, as a user's factual
    question gets);
  - word rows (made when asked for): a cloze row whose blank is one of the sentence's distinctive ordinary words
    (a lowercase word the document uses at most twice: "the main export was ___" -> "slate"), so the facts
    that are not names or numbers - materials, colours, causes - are asked about too;
  - ask rows (made when asked for): the sentence up to the end of a cue's clause, the cue turned into a question
    word ("The first settlement had how many households?"), answered by the cue: the form a user's question has;
and the teacher - the model with the document as its system turn (synth.teacher_system), or with the
`teacher_tokens` window of the document around the sentence for documents longer than the model reads well
(a 135M model answers a 6.7k-token document's questions at 0.40 and the 256-token window's at 0.77: bench/qa
skarrow) - scores every token after the system turn (its top-k logprobs), as synth's rows. Every sentence gets
rows, so the cartridge is taught the whole document, not the parts a question writer happens to pick.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from final.training.rows import Conversation, append
from final.training.document.sentences import MARKER, TITLES, table_headers, unwrap, unwrapped_sentences
from final.training.teacher import (ChunkContext, by_teacher, teacher_system, teacher_window, token_offsets,
                                     token_range)
from final.errors import CartridgeError
from final.prompts import continuation_ids

QUOTE = ("What does the document say about {cue}?", "Tell me about {cue}.", "What do we know about {cue}?",
         "What is said about {cue} in the document?")
CLOZE = ('Fill in the blank from the document: "{blanked}"',
         'According to the document, what goes in the blank? "{blanked}"')
KINDS = ("quote", "cloze", "word", "ask")
# a row's answer: the document's own words (verbatim: the sentence, the blanked cue), or the teacher's own greedy
# answer to the question in its context (the path a free answer takes; measured on the long document's tune half:
# 0.26 MC accuracy against the document's words' 0.32, as the 135M teacher's free answers carry its inventions)
ANSWERS = ("document", "teacher")
MIN_WINDOW = 16  # the fewest tokens of a teacher's window or of a chunk a start is cut from
DEFAULT_KINDS = ("quote", "cloze")  # what `learn` makes unless told (bench/RESULTS.md: measured on the tune halves)
_SPACES = re.compile(r"(?<=\S) {2,}(?=\S)")
_WORDY = re.compile(r"[^\W_]")  # a blank needs words around it: "## ___" (a heading blanked) asks nothing
_YEAR = re.compile(r"1\d{3}|20\d{2}")
_CLAUSE_END = re.compile(r"[,;:.!?](?=\s|$)")
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
# Ordinary words no fact hangs on: a word row never blanks one (the document's frequent words are left out by count).
_PLAIN = frozenset("about above across after again against along also although among another around became because "
                   "been before being below between both came come could does done during each either else every "
                   "first from have having into itself just last later less like made make many more most much "
                   "must near next once only other over same second several shall should since some still such "
                   "than that their them then there these they this those though through under until upon used "
                   "uses using very were what when where which while whose will with within without would your "
                   "back down part took take given gave says said known".split())
_DETERMINERS = frozenset("a an the its their his her our of some".split())
_WORD = re.compile(r"(?<![\w'-])[a-z][a-z'-]{3,}(?![\w'-])")
# Capitalised only because a sentence starts with them: never a cue on their own.
_FUNCTION = frozenset("a an and as at by for from in it its on the their there these this those to when where "
                      "which while with after before during since until each every all some most many".split())


@dataclass
class FactConfig:
    kinds: tuple[str, ...] = DEFAULT_KINDS
    quote_sentences: int = 2  # sentences in a quote row's answer
    cues: int = 3  # quote rows per sentence (one per cue, at most)
    # sentences before a cloze row's blanked one, quoted with it: "It was founded in ___" names no subject, and a
    # user's question about that fact does ("When was Brennock Ferry founded?")
    cloze_context: int = 0
    words: int = 3  # word rows per sentence (its distinctive words, nouns first, at most)
    teacher_tokens: int | None = None  # None: the whole document is the teacher's system turn
    # with teacher_tokens: each row's teacher is the fixed window (tile) of the document that holds its sentence
    # nearest its middle, not a window centred on it: a handful of prefills a document, not one a sentence
    teacher_tiles: bool = False
    top_k: int = 20
    seed: int = 0
    answers: str = "document"  # ANSWERS
    answer_tokens: int = 64  # the most tokens of a teacher's answer

    def check(self) -> None:
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise CartridgeError(f"unknown fact kinds {unknown}; choose from {list(KINDS)}", field="fact_kinds")
        if self.answers not in ANSWERS:
            raise CartridgeError(f"unknown answers {self.answers!r}; choose from {list(ANSWERS)}", field="answers")
        for key in ("quote_sentences", "cues", "words", "top_k", "answer_tokens"):
            if getattr(self, key) < 1:
                raise CartridgeError(f"must be at least 1, got {getattr(self, key)}", field=key)
        if self.cloze_context < 0:
            raise CartridgeError(f"must be at least 0, got {self.cloze_context}", field="cloze_context")
        if self.teacher_tiles and self.teacher_tokens is None:
            raise CartridgeError("tiles are windows of teacher_tokens: give both", field="teacher_tiles")
        if self.teacher_tokens is not None and self.teacher_tokens < MIN_WINDOW:
            raise CartridgeError(f"must be at least {MIN_WINDOW}, got {self.teacher_tokens}", field="teacher_tokens")


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
    """Per sentence, in document order: up to `cues` quote rows, one cloze row per cue, up to `words` word rows and
    one ask row per cue (cfg.kinds)."""
    rng = random.Random(cfg.seed)
    text = unwrap(text)  # a hard wrap is a space in questions and answers (the spans are the document's)
    spans = unwrapped_sentences(text)
    known = names(text)
    counts = word_counts(text)
    headers = table_headers(text)
    out = []
    for i, (lo, hi) in enumerate(spans):
        sentence = text[lo:hi]
        found = cues(sentence, known)
        # a table's row is quoted and blanked under its header, which names its cells, and alone: the next row is
        # another record; any other sentence with the ones before it (cloze_context) and after it (quote)
        header = headers.get(lo)
        lead = text[header[0]:header[1]] + "\n" if header else ""
        marker = MARKER.match(sentence)
        opening = marker.end() if marker else 0  # where the words start, past "- " or "4. "
        if "quote" in cfg.kinds:
            end = hi if header else spans[min(i + cfg.quote_sentences, len(spans)) - 1][1]
            # a sentence without names or numbers is still quoted, asked about by its opening words
            for cue in found[:cfg.cues] or [" ".join(sentence[opening:].split()[:5]).rstrip(".,:;")]:
                out.append(FactPrompt("quote", rng.choice(QUOTE).format(cue=cue), lead + text[lo:end], (lo, end)))
        start = lo if header else spans[max(0, i - cfg.cloze_context)][0]
        blanks = []
        if "cloze" in cfg.kinds:  # a cue at 0 is the sentence's subject (after an item's "- ", its key: "- Crossing
            # time: 35 minutes" asks for 35): blanking it leaves nothing to ask from
            blanks += [("cloze", sentence.find(cue), cue) for cue in found if sentence.find(cue) > opening]
        if "word" in cfg.kinds:
            blanks += [("word", at, word) for at, word in plain_words(sentence, found, counts)[:cfg.words]]
        for kind, at, answer in blanks:
            if not _WORDY.search(sentence[:at] + sentence[at + len(answer):]):
                continue
            blanked = lead + text[start:lo] + sentence[:at] + "___" + sentence[at + len(answer):]
            out.append(FactPrompt(kind, rng.choice(CLOZE).format(blanked=blanked), answer, (start, hi)))
        if "ask" in cfg.kinds and not header:  # a row's cells are no clause to turn into a question
            out += [FactPrompt("ask", q, cue, (lo, hi)) for cue, q in asked(sentence, found)]
    # unwrap pads a word joined across a hyphen's wrap with the break's spaces ("red-brick  mill"): one is a space
    return [FactPrompt(p.kind, _SPACES.sub(" ", p.question), _SPACES.sub(" ", p.answer), p.span) for p in out]


def word_counts(text: str) -> dict[str, int]:
    """How often the document uses each word, case folded ("Slate" and "slate" are one): a word it repeats is its
    topic, not a fact."""
    counts: dict[str, int] = {}
    for w in re.findall(r"[A-Za-z][A-Za-z'-]*", text):
        counts[w.lower()] = counts.get(w.lower(), 0) + 1
    return counts


def plain_words(sentence: str, found: list[str], counts: dict[str, int]) -> list[tuple[int, str]]:
    """(offset, word) of the sentence's distinctive ordinary words: lowercase, four letters or more, not in _PLAIN
    or an adverb (-ly), used at most twice by the document, and not inside a cue (a number word is a cue already,
    asked by its cloze row). Nouns first - a word after an article, possessive or number ("the ___", "four ___"),
    which is what a question asks for ("What was the main export?") - then the rarer, then the longer."""
    inside = [(m.start(), m.start() + len(c)) for c in found for m in re.finditer(re.escape(c), sentence)]
    picked: dict[str, tuple[int, bool]] = {}
    for m in _WORD.finditer(sentence):
        w = m.group(0).rstrip("'-")
        if (w in _PLAIN or w.endswith("ly") or counts.get(w, 0) > 2 or w in picked
                or any(a <= m.start() < b for a, b in inside)):
            continue
        before = sentence[:m.start()].split()[-1:]
        noun = bool(before) and (before[0].lower() in _DETERMINERS or before[0][0].isdigit()
                                 or re.fullmatch(NUMBER_WORDS, before[0].lower()) is not None)
        picked[w] = (m.start(), noun)
    order = sorted(picked, key=lambda w: (not picked[w][1], counts.get(w, 0), -len(w), picked[w][0]))
    return [(picked[w][0], w) for w in order]


def asked(sentence: str, found: list[str]) -> list[tuple[str, str]]:
    """(cue, question) per cue: the sentence up to the end of the cue's clause, the cue turned into a question
    word, as a user asks ("The first settlement had eleven households" -> "The first settlement had how many
    households?"; a sentence's subject -> "What ...?"). Unlike a cloze row, nothing after the clause is shown."""
    out = []
    for cue in found:
        at = sentence.find(cue)
        end = _CLAUSE_END.search(sentence, at + len(cue))
        tail = sentence[at + len(cue):end.start() if end else len(sentence)].rstrip()
        if at == 0:
            if tail.strip():
                out.append((cue, "What" + tail + "?"))
            continue
        word = "which year" if _YEAR.fullmatch(cue) else "how many" if cue[0].isdigit() or cue[0].islower() \
            else "what"
        out.append((cue, sentence[:at] + word + tail + "?"))
    return out



def fact_rows(inference: Any, text: str, cfg: FactConfig, batch: int = 16,
              given: Sequence[list[int]] | None = None) -> list[Conversation]:
    """The fact prompts scored by the teacher: every token after the system turn gets its top-k (as synth's rows
    with supervise="all": the question's names are targets too). The answer ends with the end-of-turn token, so
    the cartridge also learns where an answer stops. `given`: answers made elsewhere, one per fact_prompts(text,
    cfg) row in its order (a cartridge's own: bench/cartridge_own_answers.py), scored instead of cfg.answers'."""
    cfg.check()
    prompts = fact_prompts(text, cfg)
    if not prompts:
        raise CartridgeError("the document has no sentences to ask about", field="text")
    if given is not None and len(given) != len(prompts):
        raise CartridgeError(f"{len(given)} answers given for {len(prompts)} fact prompts", field="given")
    tok = inference.tokenizer
    offsets = token_offsets(tok, text)
    end = end_of_turn(tok)
    rows: list[Conversation | None] = [None] * len(prompts)
    for ctx, ids in by_teacher(inference, teacher_systems(tok, text, prompts, cfg, offsets), f"__facts-{cfg.seed}"):
        for b in range(0, len(ids), batch):
            part = ids[b:b + batch]
            asked, answers = map(list, zip(*(prompt_ids(tok, prompts[i], end) for i in part)))
            if given is not None:
                answers = [given[i] for i in part]
            elif cfg.answers == "teacher":
                answers = teacher_answers(ctx, [prompts[i] for i in part], end, cfg.answer_tokens)
            for i, q, a, (tops, _) in zip(part, asked, answers, ctx.teacher_scores(asked, answers, cfg.top_k)):
                fp = prompts[i]
                said = (fp.answer if given is None and cfg.answers == "document"
                        else tok.decode(a, skip_special_tokens=True))
                rows[i] = Conversation(i, q, a, [[t for t, _ in top] for top in tops],
                                       [[lp for _, lp in top] for top in tops], fp.kind, fp.question,
                                       said, token_range(offsets, fp.span), 1)
    return [r for r in rows if r is not None]



def teacher_systems(tok: Any, text: str, prompts: Sequence[FactPrompt], cfg: FactConfig,
                    offsets: list[tuple[int, int]]) -> list[str]:
    """Each fact prompt's teacher, as its system turn: the whole document, or the cfg.teacher_tokens window of it
    around the prompt's sentence (offsets: token_offsets(tok, text))."""
    if not cfg.teacher_tokens:
        return [teacher_system(text)] * len(prompts)
    return [teacher_window(tok, text, fp.span, cfg.teacher_tokens, offsets, cfg.teacher_tiles) for fp in prompts]


def teacher_answers(ctx: ChunkContext, fps: list[FactPrompt], end: int, tokens: int) -> list[list[int]]:
    """The teacher's greedy answers to the rows' questions in its context, closed by `end` where it stopped (a
    cut answer stays open): the words the model itself answers with when it reads the document, rather than the
    document's sentence, which a question rarely asks for verbatim."""
    out = ctx.generate([[{"role": "user", "content": fp.question}] for fp in fps], temperature=0.0,
                       max_tokens=tokens)
    return [closed_answer(row, end) for row in out.rows()]


def closed_answer(row: Any, end: int) -> list[int]:
    """A generated row (final.outputs.Completion) as a row's answer ids: closed by one `end` where it stopped, as
    prompt_ids closes the document's answers; a row cut at its token budget stays open (never empty)."""
    got = list(row.output_ids)
    while got and got[-1] == end:
        got.pop()
    return got + [end] if row.finish_reason == "stop" else got or [end]


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
