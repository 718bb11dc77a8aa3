"""A document's sentences, for the fact rows (facts.py): every sentence is asked about, so where one ends decides
what a row quotes and what a blank leaves around it.

The block structure is Markdown's, read by a parser (markdown.py): a code block (fenced or indented) holds no
sentence, a table's row is one sentence read under its header, a delimiter row, a setext underline or a thematic
break is none. Inside prose, list items and headings the splitter is ours: a sentence ends at an end mark, at a
full-width one (CJK text puts no space after it), or at a line break - but not at a hard wrap's: a .txt file
wrapped at 60-80 columns breaks its sentences, and the names in them ("Sallow\\nRiver"), across lines. unwrap()
tells a wrap's line break from a paragraph's or a list's by the paragraph's shape, and keeps the text's length, so
a sentence's span is the document's own. A period after an abbreviation ("Dr. Lund", "No. 3", "e.g. a tern",
"J. R. Ailes") ends nothing. A run without end marks (a transcript, a list run together) is cut at clause marks so
that no row's answer is the whole document.
"""

from __future__ import annotations

import re

from final.training.document.markdown import CODE, RULE, TABLE_HEAD, TABLE_ROW, blocks

# A sentence ends at . ! ? … (and a closing quote or bracket, straight or curly) before whitespace, at a full-width
# 。！？ (CJK text has no space after them), or at a line break that is not a hard wrap (unwrap below).
_SENTENCE_END = re.compile(r"[.!?…][\"')\]”’»]*(?=\s)|[。！？][」』\"')\]”’]*")
# A period after these ends no sentence when a name follows: titles ("Dr. Lund", "St. Mary's", "Mt. Orr")
TITLES = frozenset("Mr Mrs Ms Mme Mlle Dr Prof St Ste Mt Ft Rev Fr Gen Col Capt Cpt Maj Lt Sgt Cmdr Cdr Adm Gov "
                   "Sen Rep Hon Pres Supt Insp".split())
# ... when a number follows ("No. 3", "p. 12", "c. 1820"), or a lowercase word ("approx. five", "etc. and")
_BEFORE_NUMBER = frozenset("No Nos no nos Vol vol Vols vols p pp Fig fig Figs figs ch Ch art Art sec Sec c ca".split())
_LOWER_NEXT = frozenset("etc approx ca c incl esp resp vol vols fig figs cf al a.m p.m".split())
_NEVER_END = frozenset("e.g i.e cf viz vs".split())  # inside a sentence whatever follows
# an initial ("J. R. Ailes", "Part V. The Party") or a dotted acronym ("U.S. Navy") before a capitalised word
_INITIALS = re.compile(r"(?:[A-Z]\.)*[A-Z]")
_NEXT = re.compile(r"\s*(\S?)")
# A line that stands on its own: a heading, list item, quote, table row, code fence or indented code.
# A line's Markdown marker (heading, list item, quote): a sentence's subject, or an item's key, comes after it
MARKER = re.compile(r" {0,3}(?:#{1,6}|[-*+>]|\d{1,3}[.)])[ \t]+")
_BLOCK = re.compile(r" {0,3}(?:#|[-*+>]\s|\d{1,3}[.)]\s|\||```)|\t| {4}")
# "6. Tickets are sold..." is wrapped prose after "...when the wind reaches force", a list item after a line that
# ends a sentence or is an item itself
_NUMBERED = re.compile(r" {0,3}\d{1,3}[.)]\s")
_ENDED = re.compile(r"[.!?:;。！？][」』\"')\]]*$")
# a line of three or more -, =, * or _ alone: a setext heading's underline or a thematic break, no sentence
_RULE = re.compile(r" {0,3}([-=*_])(?:[ \t]*\1){2,}[ \t]*$")
# A paragraph whose longest line is this long may be hard-wrapped prose (wrapped text is 60-80 columns; a list of
# short "Key: value" lines without markers keeps one sentence a line).
WRAPPED = 32
# The most characters of one sentence: a run without end marks (a transcript, a list run together) is cut at its
# clause marks so that no fact row's answer is the whole document (data/qa's longest sentence: 275).
LONGEST_SENTENCE = 400


def sentences(text: str) -> list[tuple[int, int]]:
    """The document's sentences as character spans (stripped; blank ones dropped). A hard-wrapped paragraph's line
    breaks do not end its sentences (unwrap); a sentence past LONGEST_SENTENCE characters is cut at clause marks."""
    return unwrapped_sentences(unwrap(text))


def unwrapped_sentences(flat: str) -> list[tuple[int, int]]:
    """sentences() of a text already unwrapped (unwrap is not idempotent: a joined paragraph is one long line)."""
    spans = []
    roles = blocks(flat).roles
    for (lo, hi), role in zip(_lines(flat), roles):
        if role == TABLE_ROW:  # a table's row is one sentence, whatever its cells hold; its header and rule are none
            spans += _cut(flat, lo, hi)
            continue
        if role in (CODE, RULE, TABLE_HEAD) or _RULE.match(flat, lo, hi):
            continue
        start = lo
        item = _NUMBERED.match(flat, lo, hi)  # "1. Moor at the quay." is one sentence, not "1." and the rest
        for m in _SENTENCE_END.finditer(flat, item.end() if item else lo, hi):
            if _abbreviation(flat, m.start(), m.end()):
                continue
            spans += _cut(flat, start, m.end())
            start = m.end()
        spans += _cut(flat, start, hi)
    return spans


def code_spans(flat: str) -> list[tuple[int, int]]:
    """The character spans of the text's code lines (fenced or indented blocks, their fences included): no sentence
    is read there, and a quote that runs on to the next sentence stops before one."""
    return [span for span, role in zip(_lines(flat), blocks(flat).roles) if role == CODE]


def table_headers(flat: str) -> dict[int, tuple[int, int]]:
    """Where each table row of an unwrapped text starts (its sentence's start) -> its table's header row's span: a
    row's cells are named by the header ("| Sunday | 09:30 | 17:00 |" is the last sailing at 17:00 only beside
    "| Day | First sailing | Last sailing |"), so a row is asked about and quoted with it (facts.py)."""
    lines = _lines(flat)
    out = {}
    for row, head in blocks(flat).headers.items():
        cells, header = _cut(flat, *lines[row]), _cut(flat, *lines[head])
        if cells and header:
            out[cells[0][0]] = header[0]
    return out


def _abbreviation(text: str, dot: int, end: int) -> bool:
    """Whether the end mark text[dot:end] is an abbreviation's period, not a sentence's end (TITLES and the sets
    beside it): judged by the word before it and the first character after it."""
    if end != dot + 1 or text[dot] != ".":
        return False  # "?", "!" or a closing quote after the period end a sentence whatever came before
    start = dot
    while start > 0 and not text[start - 1].isspace() and text[start - 1] not in "([\"'“‘":
        start -= 1
    # the next character past any spaces, and the word before `word`: matched in place, as this runs at every
    # end mark (slicing text[end:] copied the rest of the document each time: quadratic in a long one)
    word, after = text[start:dot], _NEXT.match(text, end).group(1)
    if word in _NEVER_END or (after.isdigit() and word in _BEFORE_NUMBER):
        return True
    if after.islower() and word.lower() in _LOWER_NEXT:
        return True
    if not after.isupper():
        return False
    # "I" is an initial only after a capitalised word ("Part I. Origins"), not after "did I."
    if word == "I":
        before = text[max(0, start - 64):start].rstrip().rsplit(None, 1)[-1:] or [""]
        return before[0][:1].isupper()
    return word in TITLES or bool(_INITIALS.fullmatch(word))


def unwrap(text: str) -> str:
    """`text` with each hard wrap's line break as a space (_wrapped), so that a sentence wrapped over lines is one
    sentence and a name broken over two lines ("Sallow\\nRiver", "Okonkwo-\\nLind") one name. The same length as
    `text`: a span of it is the document's span (a word joined across a hyphen's wrap moves by a character)."""
    out = list(text)
    lines = text.split("\n")
    code = [role == CODE for role in blocks(text).roles]  # never joined: a code block's lines are not prose
    ends = [hi for _, hi in _lines(text)]  # where each line's break is
    widest = 0  # the paragraph's longest line: a paragraph is a run of non-blank lines, code apart
    words = {w.lower() for w in re.findall(r"[^\W\d_]+(?:-[^\W\d_]+)*", text)}  # as the document spells them
    for i, line in enumerate(lines):
        if i == 0 or not lines[i - 1].strip() or code[i - 1] != code[i]:
            j = next((j for j in range(i, len(lines)) if not lines[j].strip() or code[j] != code[i]), len(lines))
            widest = max((len(x.rstrip()) for x in lines[i:j]), default=0)
        if i + 1 < len(lines) and not code[i] and not code[i + 1] and _wrapped(line, lines[i + 1], widest):
            out[ends[i]] = " "
            _join_hyphen(text, out, ends[i], words)
    return "".join(out)


def _join_hyphen(text: str, out: list[str], end: int, words: set[str]) -> None:
    """A wrap after a hyphen ("Okonkwo-\nLind", "red-\nbrick": textwrap and editors break there; "popu-\nlation":
    typeset text) joins the word again in `out`, moving the break's character(s) after it as spaces so the length
    stays. The hyphen stays unless the document writes the word without it elsewhere and never with it."""
    head = re.search(r"([^\W\d_]+)-[ \t]*$", text[max(0, end - 64):end])
    tail = re.match(r"([^\W\d_]+)\S*", text[end + 1:end + 65])  # the word, and its comma or stop with it
    if not head or not tail:
        return
    first, rest, moved = head.group(1), tail.group(1), tail.group(0)
    dash = end - len(head.group(0)) + len(first)  # where the hyphen is
    drop = (first + rest).lower() in words and f"{first}-{rest}".lower() not in words
    at = dash if drop else dash + 1
    out[at:end + 1 + len(moved)] = list(moved.ljust(end + 1 + len(moved) - at))


def _wrapped(line: str, after: str, widest: int) -> bool:
    """Whether the break between `line` and the next, `after`, is a hard wrap inside a paragraph whose longest line
    has `widest` characters: the paragraph is as wide as prose (WRAPPED); the line is near its width, or the next
    line's first word would not have fitted on it (a wrap leaves at most a word's room); it is no heading or table
    row; the next line is not blank and starts no block of its own (a list after a colon)."""
    body = line.rstrip()
    block = _BLOCK.match(after) and not (_NUMBERED.match(after) and not _ENDED.search(body) and not _BLOCK.match(line))
    room = len(body) >= 0.6 * widest or len(body) + 1 + len((after.split() or [""])[0]) > widest  # the next word
    return (widest >= WRAPPED and room and bool(after.strip())
            and not body.lstrip().startswith(("#", "|")) and not block)


def _lines(text: str) -> list[tuple[int, int]]:
    """The [lo, hi) spans of text's lines (between line breaks)."""
    spans, at = [], 0
    for line in text.split("\n"):
        spans.append((at, at + len(line)))
        at += len(line) + 1
    return spans


def _cut(text: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) stripped, in pieces of at most LONGEST_SENTENCE characters cut after a clause mark (else a space)
    in a piece's second half; nothing where it is blank."""
    out = []
    while True:
        while lo < hi and text[lo].isspace():
            lo += 1
        while hi > lo and text[hi - 1].isspace():
            hi -= 1
        if hi - lo <= LONGEST_SENTENCE:
            return out + [(lo, hi)] if lo < hi else out
        piece, half = text[lo:lo + LONGEST_SENTENCE], LONGEST_SENTENCE // 2
        marks = [m.end() for m in re.finditer(r"[,;:](?=\s)|[、，；：]", piece) if m.end() > half]
        spaces = [m.start() for m in re.finditer(r"\s", piece) if m.start() > half]
        end = lo + (marks[-1] if marks else spaces[-1] if spaces else LONGEST_SENTENCE)
        out.append((lo, lo + len(text[lo:end].rstrip())))
        lo = end
