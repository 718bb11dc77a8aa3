"""Grammar libraries for the embedded engine, side by side on SmolLM2's tokenizer: llguidance and xgrammar.

For each library: the tokenizer set-up (once per engine), the compile time of a realistic tool-call JSON schema
and of a structural tag over three tools (first request, and the same text again where the library caches), and
the per-step mask time (fill every constrained row's bitmask, then feed each row its token) at batch 1 and 8,
walking a valid output token by token. Whichever library is missing is skipped (the engine depends on one of
them; install the other only for this comparison, e.g. `pip install --target /tmp/glibs xgrammar` and put that
folder on PYTHONPATH).

Reproduce: PYTHONPATH=$PWD .venv/bin/python bench/grammar_libs.py [--steps-repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from final.models import resolve_model_path

TOOLS = [
    {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "unit"], "additionalProperties": False,
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14}}}},
    {"name": "book_flight", "parameters": {
        "type": "object", "required": ["origin", "destination", "passengers"], "additionalProperties": False,
        "properties": {"origin": {"type": "string"}, "destination": {"type": "string"},
                       "passengers": {"type": "array", "items": {
                           "type": "object", "required": ["name", "age"], "additionalProperties": False,
                           "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}},
                       "class": {"enum": ["economy", "business"]}}}},
    {"name": "search", "parameters": {
        "type": "object", "required": ["query"], "additionalProperties": False,
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}, "safe": {"type": "boolean"}}}},
]
# one tool call as a JSON object: {"name": ..., "arguments": {...}} for any of the tools
CALL_SCHEMA = {"anyOf": [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                          "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]}}
                         for t in TOOLS]}
STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": True, "stop_after_first": False,
    "tags": [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{t["name"]}", "arguments": ',
              "content": {"type": "json_schema", "json_schema": t["parameters"]}, "end": "}\n</tool_call>"}
             for t in TOOLS]}}
OUTPUT = json.dumps({"name": "book_flight", "arguments": {
    "origin": "Paris", "destination": "Reykjavik", "passengers": [
        {"name": "Ada Lovelace", "age": 36}, {"name": "Alan Turing", "age": 41}], "class": "business"}})


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


class LLG:
    name = "llguidance"

    def __init__(self, path: str, vocab: int, eos: int):
        import llguidance
        import llguidance.torch

        from final.engine.grammar import llg_tokenizer

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llg_tokenizer(path, vocab, [eos])  # the engine's (it mends the GGUF conversion's decoder)
        self.cache: dict[str, object] = {}
        self.grammars: dict[str, str] = {}

    def compile_json(self, schema: dict):
        text = json.dumps(schema)
        if text in self.cache:  # no cache in llguidance itself: the engine's LRU copies its compiled matcher
            self.cache[text].deep_copy()
            return self.grammars[text]
        grammar = self.llg.LLMatcher.grammar_from_json_schema(text)
        # llguidance compiles lazily per matcher (its lexer builds states on demand): a matcher is the compile
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        self.cache[text], self.grammars[text] = matcher, grammar
        return grammar

    def compile_tag(self, tag: dict):
        tags = [self.llg.StructTag(trigger="<tool_call>", begin=t["begin"], grammar=t["content"]["json_schema"],
                                   end=t["end"]) for t in tag["format"]["tags"]]
        grammar = self.llg.LLMatcher.grammar_from_lark(self.llg.StructTag.to_grammar(tags, assume_special=False))
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, grammar, n: int):
        return [self.llg.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int, vocab: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(n, vocab)

    def step(self, matchers, mask: torch.Tensor, token: int) -> None:
        for i, m in enumerate(matchers):
            self.lt.fill_next_token_bitmask(m, mask, i)
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile_json(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def compile_tag(self, tag: dict):
        return self.compiler.compile_structural_tag(json.dumps(tag))

    def matchers(self, grammar, n: int):
        return [self.xgr.GrammarMatcher(grammar) for _ in range(n)]

    def bitmask(self, n: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, vocab)

    def step(self, matchers, mask: torch.Tensor, token: int) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        for m in matchers:
            assert m.accept_token(token)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def run(lib_cls, tokenizer, path: str, vocab: int, repeat: int) -> None:
    try:
        lib, setup = timed(lib_cls, tokenizer, vocab) if lib_cls is XGR else timed(lib_cls, path, vocab,
                                                                                     tokenizer.eos_token_id)
    except ImportError as exc:
        print(f"{lib_cls.name}: not installed ({exc})")
        return
    print(f"{lib.name}: tokenizer set-up {ms(setup)} (HF tokenizer load included for llguidance)")
    grammar, first = timed(lib.compile_json, CALL_SCHEMA)
    _, again = timed(lib.compile_json, CALL_SCHEMA)
    print(f"  tool-call JSON schema compile: first {ms(first)}, same text again (cached) {ms(again)}")
    _, tag_first = timed(lib.compile_tag, STRUCTURAL_TAG)
    print(f"  structural tag (3 tools) compile: {ms(tag_first)}")
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    for batch in (1, 8):
        per_step = []
        for _ in range(repeat):
            matchers = lib.matchers(grammar, batch)
            mask = lib.bitmask(batch, vocab)
            for token in ids:
                _, took = timed(lib.step, matchers, mask, token)
                per_step.append(took)
        print(f"  batch {batch}: mask + accept per step median {ms(statistics.median(per_step))}, "
              f"p90 {ms(sorted(per_step)[int(0.9 * len(per_step))])} ({len(ids)} tokens x {repeat})")


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--steps-repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    print(f"model {args.model}: vocab {vocab}; output under test: {len(tokenizer.encode(OUTPUT))} tokens")
    for lib in (LLG, XGR):
        run(lib, tokenizer, path, vocab, args.steps_repeat)
    print("reproduce: PYTHONPATH=$PWD .venv/bin/python bench/grammar_libs.py "
          f"--model {args.model} --steps-repeat {args.steps_repeat}")


if __name__ == "__main__":
    main()
