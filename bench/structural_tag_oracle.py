"""The structural-tag semantics of final's translation (final/engine/structural_tag.py, on llguidance) against
xgrammar's own compiler, on SmolLM2's tokenizer: for each format and text, whether the text is accepted as a
prefix and whether the grammar may end after it. Prints xgrammar's table (what tests/test_grammar.py asserts) and
every case where the two differ.

xgrammar is not a dependency of final: install it aside for this check, e.g.
    .venv/bin/python -m pip install --target /tmp/xgr xgrammar==0.2.8 apache-tvm-ffi --no-deps
    PYTHONPATH=$PWD:/tmp/xgr .venv/bin/python bench/structural_tag_oracle.py
"""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer

from final.engine.grammar import GrammarCompiler
from final.models import resolve_model_path

A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
X, Y = '<f=x>{"a": 1}</f>', '<f=y>{"a": 2}</f>'
TEXTS = ["", "hi", X, f"hi {X}", f"{X} bye", X + Y, f"{X}\n{Y}", '<f=z>{"a":1}</f>', f"hi {X} mid {Y} end",
         "A:hello", "A:", "none", "<t>x</t>", "<t>x</t>y", "<t>a</t", f"{X},{Y}", f"{X} {Y}", "a < b <f", "x <f",
         '<g=x>{"a": 3}</g>', f'hi <g=x>{{"a": 3}}</g>{X}', "bad word", "<t>x</a>", "<t>x</b>z"]


def tag(name: str) -> dict:
    return {"type": "tag", "begin": f"<f={name}>", "content": {"type": "json_schema", "json_schema": A}, "end": "</f>"}


def formats() -> dict[str, dict]:
    out = {f"triggered at_least_one={a} stop_after_first={s}": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": [tag("x"), tag("y")], "at_least_one": a,
        "stop_after_first": s} for a in (False, True) for s in (False, True)}
    out.update({
        "tag": tag("x"),
        "sequence const + any_text": {"type": "sequence", "elements": [{"type": "const_string", "value": "A:"},
                                                                       {"type": "any_text"}]},
        "or tag | const": {"type": "or", "elements": [tag("x"), {"type": "const_string", "value": "none"}]},
        "tag of any_text": {"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"},
        "any_text": {"type": "any_text"},
        "two triggers, excludes": {"type": "triggered_tags", "triggers": ["<f=", "<g="], "excludes": ["bad"],
                                   "tags": [tag("x"), {**tag("x"), "begin": "<g=x>", "end": "</g>"}]},
        "tag of any_text, two ends": {"type": "tag", "begin": "<t>", "content": {"type": "any_text"},
                                      "end": ["</a>", "</b>"]},
        "tags_with_separator at_least_one": {"type": "tags_with_separator", "tags": [tag("x"), tag("y")],
                                             "separator": ",", "at_least_one": True},
    })
    return out


def main() -> None:
    try:
        import xgrammar
    except ImportError:
        sys.exit(__doc__)
    path = resolve_model_path("builtin:smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=49152))
    ours = GrammarCompiler(path, 49152, [tok.eos_token_id])
    differ = 0
    for name, fmt in formats().items():
        text = json.dumps({"type": "structural_tag", "format": fmt})
        grammar = compiler.compile_structural_tag(text)
        print(name)
        for case in TEXTS:
            matcher = xgrammar.GrammarMatcher(grammar)
            ok = matcher.accept_string(case)
            theirs = (ok, ok and matcher.accept_token(tok.eos_token_id))
            row = ours.row("structural_tag", text)
            mine_ok = row.matcher.consume_tokens(ours.tokenizer.tokenize_str(case))
            mine = (mine_ok, mine_ok and row.matcher.is_accepting())
            differ += mine != theirs
            print(f"  {case!r:50} xgrammar {theirs}" + ("" if mine == theirs else f"   final {mine}  <- differs"))
    print(f"{differ} difference(s)")
    print("reproduce: PYTHONPATH=$PWD:/tmp/xgr .venv/bin/python bench/structural_tag_oracle.py")


if __name__ == "__main__":
    main()
