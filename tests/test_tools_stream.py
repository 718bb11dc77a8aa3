"""The pieces of tool calling that need no model: the call formats' streaming parser (final/tools/stream.py), the
reasoning split, the OpenAI message a row becomes (final/tools/reply.py), the rendering with the tools fallback
(final/chat_template.py), the constraints (final/tools/constraint.py), the checks of tools / tool_choice /
response_format (final/tools/spec.py), and the server's incremental detokenization (TextDelta)."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from final.chat_template import (FALLBACK_TOOLS, ChatOptions, capabilities, check_template_kwargs, detect_family,
                                 render_chat)
from final.errors import PromptError, ToolsError
from final.outputs import completion_text
from final.server.responses import TextDelta
from final.tools.constraint import response_constraint, tool_constraint
from final.tools.parser import ToolCallParser
from final.tools.reasoning import ReasoningStream
from final.tools.reply import Reply, ReplyPlan
from final.tools.spec import check_response_format, check_tool_choice, tool_spec
from final.tools.stream import CallStream
from multiturn_helpers import make_tool_model
from tools_helpers import SMOL, WEATHER_TOOL, add, few_shot, get_weather

CASES = {
    "hermes": ['Let me check.  \n<tool_call>\n{"name": "calc", "arguments": {"answer": "72"}}\n</tool_call>\nbye',
               'hi <tool_call>{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}</tool_call><tool_call>\n'
               '{"arguments": {"q": 1}, "name": "b"}\n</tool_call>',
               'plain answer with no call  ', '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
               '<tool_call>\n{"name": "f", "argum', 'x <tool_call>\n[{"name": "a", "arguments": {}}, {"name": "b"}]\n'
               '</tool_call>', 'bad <tool_call>{"name": "f", "arguments": {a: 1}}</tool_call>', 'partial <tool_ca',
               'ü日本 <tool_call>\n{"name": "é", "arguments": {"k": "日本"}}\n</tool_call>'],
    "qwen25": ['ok <tool_call>{"name": "calc"}</tool_call>',
               'a\n<tool_call>\n{"name": "calc", "arguments": {"b": true}}\n</tool_call>'],
    "llama3": ['{"name": "f", "parameters": {"x": 1}};{"name": "g", "parameters": {}}',
               'text <|python_tag|>{"name": "f", "parameters": {"x": "y"}}', '  {"name": "f", "parameters": {"x": 1',
               'just text {not a call}'],
    "mistral": ['Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": [1,2]}}]',
                '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}', 'no calls [TOOL_'],
}
PAIRS = [(fmt, text) for fmt, texts in CASES.items() for text in texts]


def _stream(fmt: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list]:
    stream = CallStream(ToolCallParser(fmt))
    out, calls, prev = "", {}, 0
    for cut in sorted(cuts) + [len(text)]:
        for update in (stream.feed(text[prev:cut]),):
            out += update.text
            for d in update.calls:
                calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
        prev = cut
    tail = stream.finish()
    out += tail.text
    for d in tail.calls:
        calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    return out, [tuple(calls[i]) for i in sorted(calls)], [(c.name, c.error) for c in stream.calls]


@pytest.mark.parametrize("fmt,text", PAIRS)
def test_a_stream_sends_the_same_whatever_the_cuts(fmt, text):
    whole = _stream(fmt, text, [])
    rng = random.Random(len(text))
    for _ in range(60):
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))) if len(text) > 1 else []
        assert _stream(fmt, text, cuts) == whole
    assert _stream(fmt, text, list(range(1, len(text)))) == whole  # a character at a time


@pytest.mark.parametrize("fmt,text", PAIRS)
def test_streamed_calls_agree_with_the_non_streaming_parse(fmt, text):
    """Every call the parser reads whole is streamed with the same name and arguments (as JSON), and a broken one
    carries the parser's error; the normal text is the text before the first call."""
    parsed = ToolCallParser(fmt).parse(text)
    out, calls, records = _stream(fmt, text, [])
    assert [e for _, e in records] == [c.error for c in parsed.calls]
    good = [(c.name, c.arguments) for c in parsed.calls if c.ok]
    assert [(n, json.loads(a)) for (n, a), (_, e) in zip(calls, records) if e is None] == good
    assert out.strip() == parsed.normal_text.strip() if parsed.calls else out == text


def test_a_partial_marker_is_never_sent_as_text():
    stream = CallStream(ToolCallParser("hermes"))
    assert stream.feed("The answer <tool_").text == "The answer"
    update = stream.feed('call>{"name": "f", "arguments": {"a": 1}}')
    assert update.text == "" and update.calls[0].name == "f"
    assert [c.arguments for c in update.calls[1:]] == ['{"a": 1}']


def test_arguments_stream_in_pieces_before_the_call_closes():
    stream = CallStream(ToolCallParser("qwen25"))
    pieces = [stream.feed(p).calls for p in ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', 'ty": "Pa',
                                              'ris"}}', '\n</tool_call>')]
    assert pieces[0][0].name == "get_weather" and pieces[0][0].index == 0
    assert "".join(d.arguments for p in pieces for d in p) == '{"city": "Paris"}'
    assert len([d for p in pieces for d in p if d.arguments]) >= 3


@pytest.mark.parametrize("text,forced,expected", [
    ("<think>\nI think 2+2=4.\n</think>\n\nThe answer is 4.", False, ("I think 2+2=4.", "The answer is 4.")),
    ("  plain answer ", False, (None, "  plain answer ")),
    ("<think> cut off mid thought  ", False, ("cut off mid thought", "")),
    ("reasoning first</think>answer", True, ("reasoning first", "answer")),
    ("<thi", False, (None, "<thi")),
    ("<think></think>x", False, ("", "x")),
    ("a < b", False, (None, "a < b")),
])
def test_reasoning_split(text, forced, expected):
    def run(cuts: list[int]) -> tuple:
        stream, r, c, prev = ReasoningStream(forced), "", "", 0
        for cut in sorted(cuts) + [len(text)]:
            a, b = stream.feed(text[prev:cut])
            r, c, prev = r + a, c + b, cut
        a, b = stream.finish()
        return (r + a if stream.seen else None), c + b

    assert run([]) == expected
    assert run(list(range(1, len(text)))) == expected


def test_reply_message_and_deltas_agree():
    plan = ReplyPlan(ToolCallParser("hermes"), reasoning=True)
    text = ('<think>weather needs a tool</think>\n\nChecking. <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    whole = Reply(plan).read_all(text)
    assert whole["content"] == "Checking." and whole["reasoning_content"] == "weather needs a tool"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole["tool_calls"])
    assert len({c["id"] for c in whole["tool_calls"]}) == 2
    streamed = Reply(plan)
    deltas = [d for ch in text for d in streamed.feed(ch)] + streamed.finish()
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weather needs a tool"
    first = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [(f["index"], f["function"]["name"]) for f in first] == [(0, "get_weather"), (1, "add")]
    args = {i: "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                       if "tool_calls" in d and d["tool_calls"][0]["index"] == i) for i in (0, 1)}
    assert [json.loads(args[i]) for i in (0, 1)] == [{"city": "Oslo"}, {"a": 1, "b": 2}]
    assert streamed.finish_reason("stop") == "tool_calls" and streamed.finish_reason("length") == "length"
    one = Reply(ReplyPlan(ToolCallParser("hermes"), parallel=False)).read_all(text)
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["get_weather"]  # parallel_tool_calls false
    plain = Reply(ReplyPlan(ToolCallParser("hermes"))).read_all("no call here")
    assert plain == {"role": "assistant", "content": "no call here"}


@pytest.fixture(scope="module")
def smol():
    from final.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(SMOL))


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    from final.models import resolve_model_path

    path = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("tool"))
    return AutoTokenizer.from_pretrained(path)


def test_chatml_gets_the_fallback_prompt_and_written_calls(smol):
    caps = capabilities(smol)
    assert (caps.tools, caps.tool_calls, caps.tool_role) == (False, False, True)  # SmolLM2's ChatML
    assert detect_family(smol) == "hermes"
    text = render_chat(smol, few_shot("Oslo"), ChatOptions((WEATHER_TOOL,), "hermes"))
    block = FALLBACK_TOOLS.format(tools=json.dumps(WEATHER_TOOL)).lstrip()
    assert text.startswith(f"<|im_start|>system\n{block}<|im_end|>")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>tool\nsunny in Paris<|im_end|>') in text
    own = render_chat(smol, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                      ChatOptions((WEATHER_TOOL,), "hermes"))
    assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools")  # appended to the conversation's system turn


def test_a_tool_template_renders_tools_and_calls_itself(qwen_style):
    caps = capabilities(qwen_style)
    assert (caps.tools, caps.tool_calls) == (True, True) and detect_family(qwen_style) == "qwen25"
    text = render_chat(qwen_style, few_shot("Oslo"), ChatOptions((WEATHER_TOOL,), "qwen25"))
    assert text.count('"name": "get_weather"') == 3  # the tools block and two calls, rendered by the template
    assert '<tool_response>\nsunny in Paris\n</tool_response>' in text


def test_template_kwargs_are_checked():
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for bad, field in [("x", "chat_template_kwargs"), ({"tools": 1}, "chat_template_kwargs.tools"),
                       ({"chat_template": "{{x}}"}, "chat_template_kwargs.chat_template"),
                       ({"a b": 1}, "chat_template_kwargs"), ({"x": float("nan")}, "chat_template_kwargs"),
                       ({"x": "y" * 20000}, "chat_template_kwargs")]:
        with pytest.raises(ToolsError) as err:
            check_template_kwargs(bad)
        assert err.value.field == field


def test_a_template_that_raises_is_a_prompt_error(smol):
    with pytest.raises(PromptError):
        render_chat(smol, [{"role": "user", "content": "x"}], ChatOptions(template_kwargs={"messages": 1}))


def test_python_functions_become_tools():
    spec = tool_spec([get_weather, add, WEATHER_TOOL | {"function": {**WEATHER_TOOL["function"], "name": "w2"}}])
    assert spec.names() == ["get_weather", "add", "w2"] and spec.toolset.names() == ["get_weather", "add"]
    assert spec.schemas[1]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                         "description": "The first number"}


def _no_hints(x):
    """Doc.

    Args:
        x: a value
    """


def _no_doc(x: int):
    pass


def _variadic(*xs: int):
    """Doc."""


@pytest.mark.parametrize("tools,field", [
    ([], "tools"), ("get_weather", "tools"), ([42], "tools[0]"), ([_no_hints], "tools[0]"), ([_no_doc], "tools[0]"),
    ([_variadic], "tools[0]"), ([get_weather, get_weather], "tools[1].function.name"),
    ([{"type": "code_interpreter"}], "tools[0].type"), ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
     "tools[0].function.parameters.properties"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], "tools[0].function"),
])
def test_bad_tools_name_their_field(tools, field):
    with pytest.raises(ToolsError) as err:
        tool_spec(tools)
    assert err.value.field == field


def test_tool_choice_and_response_format_checks():
    spec = tool_spec([get_weather])
    assert check_tool_choice(None, spec) == "auto" and check_tool_choice("required", spec) == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, spec) == named
    for bad, field in [("always", "tool_choice"), ({"type": "function", "function": {"name": "nope"}},
                                                    "tool_choice.function.name"), ({"type": "x"}, "tool_choice")]:
        with pytest.raises(ToolsError) as err:
            check_tool_choice(bad, spec)
        assert err.value.field == field
    with pytest.raises(ToolsError) as err:
        check_tool_choice("auto", None)
    assert err.value.field == "tool_choice"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = check_response_format({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert json.loads(response_constraint(fmt)["json_schema"]) == {**schema, "additionalProperties": False}
    assert json.loads(response_constraint({"type": "json_object"})["json_schema"]) == {"type": "object"}
    for bad, field in [({"type": "xml"}, "response_format"), ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": 5}}},
                        "response_format.json_schema.schema.type")]:
        with pytest.raises(ToolsError) as err:
            check_response_format(bad)
        assert err.value.field == field


def test_schemas_are_closed_as_xgrammar_strict_mode_reads_them():
    from final.tools.constraint import closed

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "l": {"type": "array", "items": {"type": "object", "properties": {}}},
                                               "open": {"type": "object", "additionalProperties": True,
                                                        "properties": {}}},
              "anyOf": [{"properties": {"x": {}}}], "$defs": {"d": {"type": "object", "properties": {}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["l"]["items"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True  # said so: kept
    assert out["anyOf"][0]["additionalProperties"] is False and out["$defs"]["d"]["additionalProperties"] is False
    assert closed({"type": "object"}) == {"type": "object"}  # no properties listed: any object
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


def test_constraints_per_tool_choice():
    tools = tool_spec([get_weather, add]).schemas
    assert tool_constraint("hermes", tools, "auto", True) == {}  # no strict tool: auto is unconstrained (SGLang)
    assert tool_constraint("hermes", tools, "none", True) == {}
    tag = json.loads(tool_constraint("hermes", tools, "required", False)["structural_tag"])["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"] == ["<tool_call>"]
    assert (tag["at_least_one"], tag["stop_after_first"]) == (True, True)
    assert [t["begin"] for t in tag["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                 '<tool_call>\n{"name": "add", "arguments": ']
    assert tag["tags"][1]["content"]["json_schema"]["required"] == ["a", "b"]
    named = json.loads(tool_constraint("llama3", tools, {"type": "function", "function": {"name": "add"}},
                                       True)["structural_tag"])["format"]
    assert [t["begin"] for t in named["tags"]] == ['<|python_tag|>{"name": "add", "parameters": ']
    strict = [{**tools[0], "function": {**tools[0]["function"], "strict": True}}]
    assert json.loads(tool_constraint("mistral", strict, "auto", True)["structural_tag"])["format"]["at_least_one"] \
        is False


# ---- the server's incremental detokenization ----------------------------------------------------------------
class _OldTextDelta:
    """The server's TextDelta before it decoded incrementally: the whole output at every update (the reference)."""

    def __init__(self, tokenizer, eos_ids, stop, ignore_eos):
        self.tokenizer, self.eos_ids, self.stop, self.ignore_eos = tokenizer, eos_ids, stop, ignore_eos
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def update(self, ids, final):
        from final.outputs import cut_at_stop, raw_text

        raw = raw_text(self.tokenizer, ids, eos_ids=self.eos_ids, ignore_eos=self.ignore_eos)
        text = cut_at_stop(raw, self.stop)
        end = len(text)
        if not final and len(text) == len(raw):
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta


TEXTS = ["Hello, world! The capital of France is Paris.", "日本語のテキストと emoji 🎉🚀 and accents: éàüß — “quotes”",
         "def f(x):\n    return x ** 2  # code\n\n\tTabs", "  leading spaces and   runs   ", "1234567890 3.14159 1e-9",
         "Mixed 中文 and English and 한국어 and Ελληνικά", "<|im_start|>special tokens<|im_end|> in text"]


def test_incremental_detokenization_sends_what_the_whole_decode_reads(smol):
    rng, vocab = random.Random(7), len(smol)  # once: len() of a fast tokenizer takes ~25 ms
    eos = {smol.eos_token_id}
    samples = [smol(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    samples += [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(150)]
    samples += [s[:k] + [smol.eos_token_id] + s[k:] for s in samples[:5] for k in (3,)]
    for ids in samples:
        for stop in ((), ("the",), ("ü", "🎉"), (" a", "\n\n")):
            want = completion_text(smol, ids, eos_ids=eos, stop=stop)
            new, old = TextDelta(smol, eos, stop, False), _OldTextDelta(smol, eos, stop, False)
            got_new = "".join(new.update(ids[:k], final=k == len(ids)) for k in range(1, len(ids) + 1))
            got_old = "".join(old.update(ids[:k], final=k == len(ids)) for k in range(1, len(ids) + 1))
            assert got_new == want == got_old, (ids, stop)


def test_config_keys_choose_the_parsers():
    from final.config import load_config
    from final.errors import ConfigError

    cfg = load_config({"model_path": "m", "tool_call_parser": "llama3", "reasoning_parser": "none"})
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("llama3", "none")
    assert load_config({"model_path": "m"}).tool_call_parser == "auto"
    for key, value in [("tool_call_parser", "gpt-oss"), ("reasoning_parser", "kimi")]:
        with pytest.raises(ConfigError) as err:
            load_config({"model_path": "m", key: value})
        assert err.value.key == key


def test_after_reasoning_wraps_the_constraint():
    from final.tools.constraint import after_reasoning

    tags = tool_constraint("hermes", tool_spec([get_weather]).schemas, "required", True)
    seq = json.loads(after_reasoning(tags)["structural_tag"])["format"]
    assert seq["type"] == "sequence" and seq["elements"][0] == {"type": "tag", "begin": "", "content": {
        "type": "any_text"}, "end": "</think>"}
    assert seq["elements"][1] == json.loads(tags["structural_tag"])["format"]
    wrapped = json.loads(after_reasoning({"json_schema": '{"type": "object"}'})["structural_tag"])["format"]
    assert wrapped["elements"][1] == {"type": "json_schema", "json_schema": {"type": "object"}}
    assert after_reasoning({}) == {}
