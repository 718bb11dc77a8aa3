"""Tool-call parsing (final/tools/parser.py): SGLang 0.5.2 Qwen25Detector results where SGLang succeeds, explicit
errors where it drops calls silently."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from final.errors import ToolConfigError
from final.models import resolve_model_path
from final.tools.parser import ParsedCall, ToolCallParser
from multiturn_helpers import make_tool_model

CALL = '<tool_call>\n{"name": "calc", "arguments": {"answer": "72"}}\n</tool_call>'


@pytest.fixture(params=["hermes", "qwen25"])
def parser(request):
    return ToolCallParser(request.param)


def test_single_call_matches_sglang(parser):
    # SGLang: normal_text = text before the first "<tool_call>\n", stripped; arguments round-trip through JSON
    res = parser.parse("Let me check.  \n" + CALL + "\ntrailing words")
    assert res.normal_text == "Let me check."
    assert res.calls == [ParsedCall("calc", {"answer": "72"}, None, '{"name": "calc", "arguments": {"answer": "72"}}')]
    assert parser.has_tool_call(CALL)


def test_no_call(parser):
    res = parser.parse("The answer is #### 72")
    assert not parser.has_tool_call("The answer is #### 72")
    assert res.normal_text == "The answer is #### 72" and res.calls == []


def test_several_calls_in_one_turn(parser):
    two = CALL + "\n" + CALL.replace("72", "73").replace("calc", "other")
    res = parser.parse(two)
    assert [(c.name, c.arguments) for c in res.calls] == [("calc", {"answer": "72"}), ("other", {"answer": "73"})]
    assert res.normal_text == ""


def test_json_list_in_one_block(parser):
    body = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "parameters": {"y": [1, 2]}}]'
    res = parser.parse(f"<tool_call>\n{body}\n</tool_call>")
    assert [(c.name, c.arguments, c.ok) for c in res.calls] == [("a", {"x": 1}, True), ("b", {"y": [1, 2]}, True)]


def test_unclosed_tag_at_end(parser):
    complete = parser.parse('I will call.\n<tool_call>\n{"name": "calc", "arguments": {"answer": "5"}}')
    assert complete.calls[0].ok and complete.calls[0].arguments == {"answer": "5"}
    cut = parser.parse('<tool_call>\n{"name": "calc", "argum')
    assert len(cut.calls) == 1 and not cut.calls[0].ok
    assert "ended before </tool_call>" in cut.calls[0].error


def test_malformed_json_is_an_error_not_a_drop(parser):
    res = parser.parse('<tool_call>\n{"name": "calc", "arguments": {answer: 72}}\n</tool_call>\n' + CALL)
    assert [c.ok for c in res.calls] == [False, True]
    assert "invalid JSON" in res.calls[0].error and res.calls[0].raw.startswith('{"name"')


@pytest.mark.parametrize("body, why", [
    ('"just a string"', "must be a JSON object"),
    ('[1, 2]', "must be a JSON object"),
    ('[]', "empty list"),
    ('{"arguments": {"a": 1}}', "non-empty string 'name'"),
    ('{"name": 7, "arguments": {}}', "non-empty string 'name'"),
    ('{"name": "calc", "arguments": [1]}', "must be a JSON object, got list"),
])
def test_bad_call_shapes(parser, body, why):
    res = parser.parse(f"<tool_call>\n{body}\n</tool_call>")
    assert res.calls and all(not c.ok and why in c.error for c in res.calls)


def test_argument_variants(parser):
    text = ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "g"}\n</tool_call>\n<tool_call>\n{"name": "h", "arguments": null}\n</tool_call>')
    assert [(c.name, c.arguments) for c in parser.parse(text).calls] == [("f", {"a": 1}), ("g", {}), ("h", {})]


def test_unknown_names_are_kept_for_the_rollout_to_report(parser):
    # SGLang drops calls to tools it does not know; the parser keeps them so the rollout can answer with an error
    res = parser.parse(CALL.replace("calc", "no_such_tool"))
    assert res.calls[0].ok and res.calls[0].name == "no_such_tool"


def test_hermes_accepts_tags_without_newlines_qwen25_does_not():
    text = 'ok <tool_call>{"name": "calc", "arguments": {"answer": "1"}}</tool_call>'
    assert ToolCallParser("hermes").parse(text).calls[0].arguments == {"answer": "1"}
    assert not ToolCallParser("qwen25").has_tool_call(text)  # SGLang's bot_token is "<tool_call>\n"


def test_format_detection(tmp_path):
    smol = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-random-llama"))
    tool = AutoTokenizer.from_pretrained(make_tool_model(resolve_model_path("builtin:tiny-random-llama"),
                                                         tmp_path / "m"))
    assert ToolCallParser.for_tokenizer("auto", smol).format == "hermes"  # no <tool_call> token: text-level parsing
    assert ToolCallParser.for_tokenizer(None, tool).format == "qwen25"  # SGLang's vocabulary detection
    assert ToolCallParser.for_tokenizer("hermes", tool).format == "hermes"  # an explicit format wins
    with pytest.raises(ToolConfigError) as err:
        ToolCallParser.for_tokenizer("gpt-oss", tool)
    assert err.value.key == "rollout.multi_turn.format"
