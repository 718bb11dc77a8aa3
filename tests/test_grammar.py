"""Constraint compilation (final/engine/grammar.py, structural_tag.py) without an engine: what each grammar accepts,
checked through llguidance's matcher on SmolLM2's tokenizer, and the typed errors for bad constraints.

The structural-tag table is xgrammar 0.2.8's behaviour (SGLang's default grammar backend), measured with
bench/structural_tag_oracle.py: each row is (text, accepted as a prefix, complete: EOS allowed after it)."""

from __future__ import annotations

import json

import pytest

from final.engine.grammar import MAX_BYTES, GrammarCompiler, RowGrammar, grammar_text
from final.errors import SamplingError
from final.sampling import Limits, check_params, constraint_texts, parse_sampling

A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
X, Y = '<f=x>{"a": 1}</f>', '<f=y>{"a": 2}</f>'


def tag(name: str, content: dict | None = None) -> dict:
    return {"type": "tag", "begin": f"<f={name}>", "content": content or {"type": "json_schema", "json_schema": A},
            "end": "</f>"}


def triggered(at_least_one: bool, stop_after_first: bool) -> dict:
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": [tag("x"), tag("y")], "at_least_one": at_least_one,
        "stop_after_first": stop_after_first}}


@pytest.fixture(scope="module")
def compiler(tiny_dir):
    return GrammarCompiler(tiny_dir, 49152, [2])


def verdict(compiler: GrammarCompiler, key: str, constraint, text: str) -> tuple[bool, bool]:
    """(text accepted as a prefix, complete after it)"""
    row = compiler.row(key, constraint if isinstance(constraint, str) else json.dumps(constraint))
    ok = row.matcher.consume_tokens(compiler.tokenizer.tokenize_str(text))
    return ok, ok and row.matcher.is_accepting()


CASES = ["", "hi", X, f"hi {X}", f"{X} bye", X + Y, f"{X}\n{Y}", '<f=z>{"a":1}</f>', f"hi {X} mid {Y} end"]
# xgrammar 0.2.8 (bench/structural_tag_oracle.py): complete / prefix only / rejected, per case above
TABLE = {
    (False, False): ["done", "done", "done", "done", "done", "done", "done", "no", "done"],
    (False, True): ["done", "done", "done", "done", "no", "no", "no", "no", "no"],
    (True, False): ["prefix", "no", "done", "no", "done", "done", "done", "no", "no"],
    (True, True): ["prefix", "no", "done", "no", "no", "no", "no", "no", "no"],
}
WORDS = {(True, True): "done", (True, False): "prefix", (False, False): "no"}


@pytest.mark.parametrize("flags", sorted(TABLE))
def test_triggered_tags_match_xgrammar(compiler, flags):
    got = [WORDS[verdict(compiler, "structural_tag", triggered(*flags), text)] for text in CASES]
    assert got == TABLE[flags]


def test_legacy_structural_tag_is_triggered_tags(compiler):
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=x>", "schema": A, "end": "</f>"}, {"begin": "<f=y>", "schema": A,
                                                                           "end": "</f>"}]}
    got = [WORDS[verdict(compiler, "structural_tag", legacy, text)] for text in CASES]
    assert got == TABLE[(False, False)]
    assert WORDS[verdict(compiler, "structural_tag", {**legacy, "at_least_one": True}, "hi")] == "no"


@pytest.mark.parametrize("fmt,texts", [
    (tag("x"), {X: "done", "": "prefix", f"{X} bye": "no", "hi": "no"}),
    ({"type": "sequence", "elements": [{"type": "const_string", "value": "A:"}, {"type": "any_text"}]},
     {"A:hello": "done", "A:": "done", "none": "no"}),
    ({"type": "or", "elements": [tag("x"), {"type": "const_string", "value": "none"}]},
     {X: "done", "none": "done", "hi": "no"}),
    ({"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"},
     {"<t>x</t>": "done", "<t>x</t>y": "no", "<t>a</t": "prefix"}),
    ({"type": "any_text"}, {"": "done", X: "done", "<t>x</t>y": "done"}),
    ({"type": "tags_with_separator", "tags": [tag("x"), tag("y")], "separator": ",", "at_least_one": True},
     {X: "done", f"{X},{Y}": "done", "": "prefix", f"{X} {Y}": "no"}),
])
def test_formats_match_xgrammar(compiler, fmt, texts):
    st = {"type": "structural_tag", "format": fmt}
    assert {text: WORDS[verdict(compiler, "structural_tag", st, text)] for text in texts} == texts


def test_json_schema_regex_and_ebnf(compiler):
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["kind", "tags"], "additionalProperties": False}
    assert verdict(compiler, "json_schema", schema, '{"kind": "cat", "tags": ["a"]}') == (True, True)
    assert verdict(compiler, "json_schema", schema, '{"kind": "cow"')[0] is False
    assert verdict(compiler, "json_schema", schema, '{"tags": [], "extra": 1}')[0] is False
    assert verdict(compiler, "regex", r"(yes|no)\.[0-9]{2}", "yes.42") == (True, True)
    assert verdict(compiler, "regex", r"(yes|no)\.[0-9]{2}", "maybe")[0] is False
    ebnf = 'root ::= "The answer is " num "."\nnum ::= [0-9]+'
    assert verdict(compiler, "ebnf", ebnf, "The answer is 42.") == (True, True)
    assert verdict(compiler, "ebnf", ebnf, "The answer is x")[0] is False


def test_grammars_are_compiled_once_and_each_row_has_its_own_matcher(compiler):
    before = compiler.compiles
    rows = [compiler.row("regex", "ab+c") for _ in range(3)]
    assert compiler.compiles - before <= 1 and compiler.compiles >= 1
    rows[0].accept(compiler.tokenizer.tokenize_str("ab")[0])
    assert isinstance(rows[1], RowGrammar) and not rows[1].matcher.is_accepting()
    assert rows[1].matcher.consume_tokens(compiler.tokenizer.tokenize_str("abbc"))
    compiler.row("regex", "ab+c")
    assert compiler.compiles - before <= 1


BAD = [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON schema object"),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "strng"}}}), "compiled"),
    ("json_schema", json.dumps({"type": "string", "format": "no-such-format", "x-unknown": 1}), "compiled"),
    ("regex", "(unclosed", "compiled"),
    ("ebnf", "root ::= (", "compiled"),
    ("ebnf", 'rot ::= "a"', "compiled"),
    ("structural_tag", "{", "not valid JSON"),
    ("structural_tag", json.dumps({"type": "other"}), "structural_tag"),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "token", "token": 1}}),
     "not supported"),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": A,
                                                                      "style": "qwen_xml"}}), "qwen_xml"),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<g="], "tags": [tag("x")]}}), "exactly one trigger"),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>",
                                                                      "content": {"type": "any_text"}, "end": "</a>",
                                                                      "bogus": 1}}), "bogus"),
]


@pytest.mark.parametrize("key,text,words", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_constraints_are_sampling_errors_naming_the_key(compiler, key, text, words):
    with pytest.raises(SamplingError) as info:
        compiler.row(key, text)
    assert info.value.field == key and words in str(info.value)


def test_pathological_grammars_are_refused(compiler):
    with pytest.raises(SamplingError, match="recursion") as info:  # 3,000 nested groups
        compiler.row("ebnf", "root ::= " + "(" * 3000 + '"a"' + ")" * 3000)
    assert info.value.field == "ebnf"
    with pytest.raises(SamplingError, match="bound") as info:  # past the engine's own bound (veRL's requests)
        compiler.row("regex", "a" * (MAX_BYTES + 1))
    assert info.value.field == "regex"


@pytest.mark.parametrize("params,field", [
    ({"json_schema": "{}", "regex": "a"}, "regex"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"json_schema": 3}, "json_schema"),
    ({"regex": {"a": 1}}, "regex"),
    ({"ebnf": ""}, "ebnf"),
    ({"structural_tag": ["x"]}, "structural_tag"),
    ({"json_schema": "{}", "min_new_tokens": 2}, "min_new_tokens"),
    ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_constraint_key_rules(params, field):
    with pytest.raises(SamplingError) as info:
        check_params(params)
    assert info.value.field == field


def test_generate_keys_serialize_objects_and_bound_their_size():
    parsed = parse_sampling({"json_schema": A, "max_tokens": 4}, response_length=8)
    assert parsed.params["json_schema"] == json.dumps(A)
    with pytest.raises(SamplingError, match="max_grammar_bytes") as info:
        parse_sampling({"regex": "a" * 200}, response_length=8, limits=Limits(max_grammar_bytes=100))
    assert info.value.field == "regex"
    assert constraint_texts({"structural_tag": {"type": "structural_tag"}}) == {
        "structural_tag": '{"type": "structural_tag"}'}


def test_grammar_text_refuses_unknown_keys():
    with pytest.raises(SamplingError):
        grammar_text("choice", "[]")
