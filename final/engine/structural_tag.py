"""SGLang's `structural_tag` (xgrammar's structural tag formats) as an llguidance Lark grammar.

Two input forms, as SGLang 0.5.12's xgrammar backend takes them:
- legacy: {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [str]} (+ at_least_one),
  which xgrammar reads as triggered_tags over tags whose content is the JSON schema;
- {"type": "structural_tag", "format": {...}} with xgrammar's formats: const_string, json_schema, regex, any_text,
  sequence, or, tag, triggered_tags, tags_with_separator, optional, plus, star, repeat.
The semantics are xgrammar 0.2.8's (tests/test_structural_tag.py holds the table measured against it,
bench/structural_tag_oracle.py re-measures it): triggered_tags lets free text run until a trigger, and the text
may contain no trigger that does not start one of the tags; with at_least_one the output starts with a tag (no
text before it); with stop_after_first it ends right after the first tag; any_text inside a tag stops at the
first occurrence of the tag's end. Formats xgrammar has that tool calling does not need (token-level formats,
XML argument styles, dispatch, embedded EBNF) are refused with a SamplingError naming the format.
"""

from __future__ import annotations

import json
import re
from typing import Any

from final.errors import SamplingError

FIELD = "structural_tag"
ANY = r"(.|\n)*"
_ALLOWED = {  # format type -> its fields (besides "type"); a field outside these is refused, not ignored
    "const_string": {"value"}, "json_schema": {"json_schema", "style"}, "regex": {"pattern"},
    "any_text": {"excludes"}, "sequence": {"elements"}, "or": {"elements"}, "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
    "optional": {"content"}, "plus": {"content"}, "star": {"content"}, "repeat": {"min", "max", "content"},
}


def _fail(message: str) -> SamplingError:
    return SamplingError(message, FIELD)


def structural_tag_to_lark(tag: Any) -> str:
    """A parsed structural tag (dict) -> an llguidance Lark grammar. Raises SamplingError naming the problem."""
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
        raise _fail('must be an object with "type": "structural_tag"')
    if "structures" in tag or "triggers" in tag:
        fmt = _legacy(tag)
    elif "format" in tag:
        extra = set(tag) - {"type", "format"}
        if extra:
            raise _fail(f"unknown field {sorted(extra)[0]!r} (a structural tag has type and format)")
        fmt = tag["format"]
    else:
        raise _fail('needs "format", or the legacy "structures" and "triggers"')
    lark = _Lark()
    lark.rules.insert(0, f"start: {lark.expr(fmt, 'format')}")
    return "\n".join(lark.rules) + "\n"


def _legacy(tag: dict) -> dict:
    """xgrammar's StructuralTag.from_legacy_structural_tag, with SGLang's at_least_one."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise _fail("the legacy form needs non-empty lists 'structures' and 'triggers'")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) != {"begin", "schema", "end"}:
            raise _fail(f"structures[{i}] must be an object with exactly begin, schema and end")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags,
            "at_least_one": tag.get("at_least_one", False), "stop_after_first": False}


def _lit(text: str) -> str:
    return json.dumps(text)


def _re(text: str) -> str:
    """A literal inside a /regex/ (Rust regex syntax; the slash escaped for Lark)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$/-])", r"\\\1", text).replace("\n", r"\n")


def _ends_with_any_text(fmt: Any) -> bool:
    """Whether a format's text ends in any_text (which then has to stop at what follows it)."""
    if not isinstance(fmt, dict):
        return False
    if fmt.get("type") == "sequence" and isinstance(fmt.get("elements"), list) and fmt["elements"]:
        return _ends_with_any_text(fmt["elements"][-1])
    return fmt.get("type") == "any_text"


def _strings(value: Any, where: str, empty: bool = False) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) and (s or empty) for s in value):
        raise _fail(f"{where} must be a list of {'' if empty else 'non-empty '}strings")
    return value


class _Lark:
    def __init__(self) -> None:
        self.rules: list[str] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def expr(self, fmt: Any, where: str, follow: list[str] | None = None) -> str:
        """The Lark expression of one format. `follow`: the literal(s) that must come right after it (a tag's
        end), which any_text stops at."""
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise _fail(f"{where} must be an object with a string 'type'")
        kind = fmt["type"]
        if kind not in _ALLOWED:
            raise _fail(f"{where}: format type {kind!r} is not supported; supported: {', '.join(sorted(_ALLOWED))}")
        extra = set(fmt) - _ALLOWED[kind] - {"type"}
        if extra:
            raise _fail(f"{where}: unknown or unsupported field {sorted(extra)[0]!r} of a {kind} format")
        return getattr(self, f"_{kind}")(fmt, where, follow)

    def _const_string(self, fmt: dict, where: str, follow: Any) -> str:
        if not isinstance(fmt.get("value"), str):
            raise _fail(f"{where}.value must be a string")
        return _lit(fmt["value"])

    def _json_schema(self, fmt: dict, where: str, follow: Any) -> str:
        schema = fmt.get("json_schema")
        if fmt.get("style", "json") != "json":
            raise _fail(f"{where}.style {fmt['style']!r} is not supported (only json)")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise _fail(f"{where}.json_schema must be a JSON schema object (or true)")
        return f"%json {json.dumps(schema)}"

    def _regex(self, fmt: dict, where: str, follow: Any) -> str:
        if not isinstance(fmt.get("pattern"), str) or not fmt["pattern"]:
            raise _fail(f"{where}.pattern must be a non-empty string")
        return "/" + fmt["pattern"].replace("/", r"\/") + "/"

    def _free(self, excludes: list[str], stops: list[str]) -> str:
        """A terminal of free text that contains none of `excludes` (nor of the stops)."""
        banned = excludes + stops
        free = f"/{ANY}/" + (f" & ~/{ANY}({'|'.join(_re(s) for s in banned)}){ANY}/" if banned else "")
        name = f"FREE{len(self.rules)}"
        self.rules.append(f"{name}: {free}")
        return name

    def _any_text(self, fmt: dict, where: str, follow: list[str] | None) -> str:
        excludes = _strings(fmt.get("excludes", []), f"{where}.excludes")
        if not follow:
            return self._free(excludes, [])
        # text up to the first occurrence of what follows (a tag's end): one lazy lexeme that eats the end too;
        # the caller then emits nothing for the end
        free = self._free(excludes, follow)
        return self.rule(f"{free} ({' | '.join(_lit(s) for s in follow)})", lazy=True)

    def _sequence(self, fmt: dict, where: str, follow: Any) -> str:
        elements = fmt.get("elements")
        if not isinstance(elements, list) or not elements:
            raise _fail(f"{where}.elements must be a non-empty list")
        parts = []
        for i, element in enumerate(elements):
            if isinstance(element, dict) and element.get("type") == "any_text" and i < len(elements) - 1:
                raise _fail(f"{where}.elements[{i}]: any_text is supported only last in a sequence or as a "
                            "tag's content")
            parts.append(self.expr(element, f"{where}.elements[{i}]", follow if i == len(elements) - 1 else None))
        return "(" + " ".join(parts) + ")"

    def _or(self, fmt: dict, where: str, follow: Any) -> str:
        elements = fmt.get("elements")
        if not isinstance(elements, list) or not elements:
            raise _fail(f"{where}.elements must be a non-empty list")
        return "(" + " | ".join(self.expr(e, f"{where}.elements[{i}]") for i, e in enumerate(elements)) + ")"

    def _tag(self, fmt: dict, where: str, follow: Any, skip: int = 0) -> str:
        """begin content end; `skip` characters of begin are already matched (a trigger)."""
        begin, end = fmt.get("begin"), fmt.get("end")
        if not isinstance(begin, str):
            raise _fail(f"{where}.begin must be a string (token begins are not supported)")
        ends = [end] if isinstance(end, str) else _strings(end, f"{where}.end", empty=True)
        if not ends:
            raise _fail(f"{where}.end must be a string or a non-empty list of strings")
        content = fmt.get("content")
        ends_in_content = _ends_with_any_text(content) and any(ends)
        body = self.expr(content, f"{where}.content", [e for e in ends if e] if ends_in_content else None)
        close = "" if ends_in_content else "(" + " | ".join(_lit(e) for e in ends) + ")"
        return f"({_lit(begin[skip:])} {body} {close})"

    def _tag_list(self, fmt: dict, where: str) -> list[dict]:
        tags = fmt.get("tags")
        if not isinstance(tags, list) or not tags:
            raise _fail(f"{where}.tags must be a non-empty list of tag formats")
        for i, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("type", "tag") != "tag":
                raise _fail(f"{where}.tags[{i}] must be a tag format")
        return [{**t, "type": "tag"} for t in tags]

    def _flags(self, fmt: dict, where: str) -> tuple[bool, bool]:
        flags = fmt.get("at_least_one", False), fmt.get("stop_after_first", False)
        if not all(isinstance(f, bool) for f in flags):
            raise _fail(f"{where}: at_least_one and stop_after_first must be true or false")
        return flags

    def _triggered_tags(self, fmt: dict, where: str, follow: Any) -> str:
        triggers = _strings(fmt.get("triggers"), f"{where}.triggers")
        if not triggers:
            raise _fail(f"{where}.triggers must not be empty")
        for a in triggers:
            if any(a != b and b.startswith(a) for b in triggers):
                raise _fail(f"{where}.triggers: {a!r} is a prefix of another trigger")
        tags = self._tag_list(fmt, where)
        at_least_one, stop_after_first = self._flags(fmt, where)
        free = self._free(_strings(fmt.get("excludes", []), f"{where}.excludes"), triggers)
        tagged, bare = [], []
        for i, t in enumerate(tags):
            begin = t.get("begin")
            owners = [trig for trig in triggers if isinstance(begin, str) and begin.startswith(trig)]
            if len(owners) != 1:
                raise _fail(f"{where}.tags[{i}].begin must start with exactly one trigger, got {begin!r}")
            lead = self.rule(f"{free} {_lit(owners[0])}", lazy=True)  # free text, then the trigger
            tagged.append(f"{lead} {self._tag(t, f'{where}.tags[{i}]', None, skip=len(owners[0]))}")
            bare.append(self._tag(t, f"{where}.tags[{i}]", None))
        any_tagged, any_bare = self.rule(" | ".join(tagged)), self.rule(" | ".join(bare))
        if at_least_one:
            return any_bare if stop_after_first else f"({any_bare} {any_tagged}* {free})"
        return f"({any_tagged} | {free})" if stop_after_first else f"({any_tagged}* {free})"

    def _tags_with_separator(self, fmt: dict, where: str, follow: Any) -> str:
        tags = self._tag_list(fmt, where)
        if not isinstance(fmt.get("separator"), str):
            raise _fail(f"{where}.separator must be a string")
        at_least_one, stop_after_first = self._flags(fmt, where)
        one = self.rule(" | ".join(self._tag(t, f"{where}.tags[{i}]", None) for i, t in enumerate(tags)))
        many = one if stop_after_first else f"({one} ({_lit(fmt['separator'])} {one})*)"
        return many if at_least_one else f"({many})?"

    def _repeat_of(self, fmt: dict, where: str, op: str) -> str:
        return f"({self.expr(fmt.get('content'), f'{where}.content')}){op}"

    def _optional(self, fmt: dict, where: str, follow: Any) -> str:
        return self._repeat_of(fmt, where, "?")

    def _plus(self, fmt: dict, where: str, follow: Any) -> str:
        return self._repeat_of(fmt, where, "+")

    def _star(self, fmt: dict, where: str, follow: Any) -> str:
        return self._repeat_of(fmt, where, "*")

    def _repeat(self, fmt: dict, where: str, follow: Any) -> str:
        low, high = fmt.get("min"), fmt.get("max")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or low < 0 or (
                high != -1 and high < low):
            raise _fail(f"{where}: min must be an integer >= 0 and max >= min (or -1: unbounded)")
        return self._repeat_of(fmt, where, f"{{{low},}}" if high == -1 else f"{{{low},{high}}}")
