"""A document's block structure, read by a Markdown parser (markdown-it-py, CommonMark with GitHub's tables): what
each line is, so the sentence splitter (sentences.py) reads prose, list items, headings and table rows, and leaves
out what carries no sentence - code (fenced or indented), a table's delimiter row, a setext heading's underline,
a thematic break. Line numbers are the text's own (`text.split("\\n")`), as markdown-it's token maps give them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from markdown_it import MarkdownIt

TEXT, CODE, RULE, TABLE_HEAD, TABLE_ROW = "text", "code", "rule", "table_head", "table_row"
_PARSER = MarkdownIt("commonmark").enable("table")


@dataclass(frozen=True)
class Blocks:
    """Per line of a text: its role (TEXT, CODE, RULE, TABLE_HEAD, TABLE_ROW) and, for a table row, the line of its
    table's header row."""
    roles: tuple[str, ...]
    headers: dict[int, int]


@lru_cache(maxsize=8)
def blocks(text: str) -> Blocks:
    """The roles of `text`'s lines (blank lines and lines outside any block are TEXT)."""
    roles = [TEXT] * (text.count("\n") + 1)
    headers: dict[int, int] = {}
    head = None
    for token in _PARSER.parse(text):
        if token.type == "table_close":
            head = None
        if token.map is None:
            continue
        lo, hi = token.map
        if token.type in ("fence", "code_block"):
            roles[lo:hi] = [CODE] * (hi - lo)
        elif token.type == "hr":
            roles[lo:hi] = [RULE] * (hi - lo)
        elif token.type == "heading_open" and hi - lo == 2:  # a setext heading: its second line underlines it
            roles[hi - 1] = RULE
        elif token.type == "thead_open":
            head = lo
            roles[lo] = TABLE_HEAD
            roles[lo + 1] = RULE  # the delimiter row under the header
        elif token.type == "tr_open" and head is not None and lo != head:
            roles[lo] = TABLE_ROW
            headers[lo] = head
    return Blocks(tuple(roles), headers)
