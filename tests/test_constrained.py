"""Constrained decoding on the embedded engine (real models): every constrained output validates against its
constraint, with n > 1 and seeds, greedy and sampled, with a cartridge, on fp32 / bf16 / int8 weights and on the
kernel and torch paths; the logprobs are the masked distribution's; bad constraints are typed errors and the engine
keeps serving; unconstrained rows are untouched by constrained ones beside them."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from final.engine import EmbeddedEngine
from final.errors import SamplingError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 24},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}},
              "address": {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
                  "city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
# for random weights: no free whitespace (x-guidance is llguidance's own option; validators ignore the keyword)
COMPACT = {**PERSON, "x-guidance": {"whitespace_flexible": False}}
CALL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}


def call_tag(name: str) -> dict:
    return {"type": "tag", "begin": f'<tool_call>\n{{"name": "{name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": CALL}, "end": "}\n</tool_call>"}


TOOLS = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [call_tag("get_weather"), call_tag("get_time")],
         "at_least_one": True, "stop_after_first": True}
TWO_CALLS = {"type": "structural_tag", "format": {"type": "sequence", "elements": [TOOLS, {
    "type": "const_string", "value": "\n"}, TOOLS]}}
CALL_RE = re.compile(r'<tool_call>\n\{"name": "(get_weather|get_time)", "arguments": (.*?)\}\n</tool_call>', re.S)


slow = pytest.mark.slow  # SmolLM2 decodes: 10-100 s each on two loaded cores


@pytest.fixture(scope="module")
def tok(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def smol(smol_dir):
    engine = EmbeddedEngine(smol_dir, max_model_len=512)
    yield engine
    engine.shutdown()


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def texts(tok, outs) -> list[str]:
    return [tok.decode(o["output_ids"], skip_special_tokens=True) for o in outs]


def stopped(outs) -> bool:
    return all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)


@slow
def test_json_schema_outputs_validate_greedy_and_sampled_with_n(smol, tok):
    ids = [chat(tok, "Describe a person as JSON: name, age, pets and address.")]
    for params in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "n": 3, "seed": 7}):
        outs = smol.generate(ids, {"max_new_tokens": 160, "json_schema": json.dumps(PERSON), **params})
        assert len(outs) == params.get("n", 1) and stopped(outs)
        for text in texts(tok, outs):
            jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts(tok, outs))) > 1  # each row followed its own sample (its own matcher)


@slow
def test_regex_and_ebnf_outputs_match(smol, tok):
    ids = chat(tok, "Is the sky blue? Answer and say why.")
    pattern = r"(Yes|No), because [a-z ,]{5,60}\."
    for params in ({"temperature": 0}, {"temperature": 1.0, "n": 4, "seed": 3}):
        outs = smol.generate([ids], {"max_new_tokens": 40, "regex": pattern, **params})
        assert stopped(outs) and all(re.fullmatch(pattern, t) for t in texts(tok, outs))
    ebnf = 'root ::= "The answer is " num "."\nnum ::= [1-9] [0-9]{0,3}'
    outs = smol.generate([chat(tok, "What is 12 times 12?")], {"max_new_tokens": 20, "ebnf": ebnf, "n": 3,
                                                               "seed": 5, "temperature": 1.0})
    assert stopped(outs) and all(re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", t) for t in texts(tok, outs))


def parse_calls(text: str) -> list[tuple[str, dict]]:
    calls = [(m.group(1), json.loads(m.group(2))) for m in CALL_RE.finditer(text)]
    for _, arguments in calls:
        jsonschema.validate(arguments, CALL)
    return calls


@slow
def test_structural_tags_give_valid_tool_calls(smol, tok):
    ids = chat(tok, "What is the weather in Paris, and what time is it in Tokyo?")
    legacy = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": t["begin"], "schema": CALL, "end": t["end"]} for t in TOOLS["tags"]]}
    at_least_one = {"type": "structural_tag", "format": {**TOOLS, "stop_after_first": False}}
    out = smol.generate(ids, {"max_new_tokens": 60, "temperature": 0, "structural_tag": json.dumps(at_least_one)})
    text = texts(tok, [out])[0]
    assert text.startswith("<tool_call>") and len(parse_calls(text)) >= 1  # at_least_one: no text before it
    outs = smol.generate([ids], {"max_new_tokens": 100, "temperature": 1.0, "seed": 2, "n": 2,
                                     "structural_tag": json.dumps(TWO_CALLS)})
    assert stopped(outs)
    for text in texts(tok, outs):  # two calls in a row (parallel calls), nothing else
        calls = parse_calls(text)
        assert len(calls) == 2 and CALL_RE.sub("", text) == "\n"
    out = smol.generate(ids, {"max_new_tokens": 60, "temperature": 0, "structural_tag": legacy})  # a dict too
    parse_calls(texts(tok, [out])[0])  # text, then (if any) valid calls


@slow
def test_logprobs_are_the_masked_distribution(smol, tok):
    ids = chat(tok, "Say yes or no.")
    for params in ({"temperature": 0}, {"temperature": 0.7, "seed": 1}):
        out = smol.generate(ids, {"max_new_tokens": 4, "regex": "(yes|no|maybe)!", **params}, return_logprob=True,
                            top_logprobs_num=20)
        first = out["meta_info"]["output_top_logprobs"][0]
        allowed = [lp for lp, _, _ in first if lp > -1e30]
        assert 1 <= len(allowed) < 20  # only a few tokens can start yes / no / maybe
        assert math.fsum(math.exp(lp) for lp in allowed) == pytest.approx(1.0, abs=1e-4)
        chosen, token, _ = out["meta_info"]["output_token_logprobs"][0]
        assert chosen == pytest.approx(dict((t, lp) for lp, t, _ in first)[token], abs=1e-6)
        assert tok.decode(out["output_ids"], skip_special_tokens=True) in ("yes!", "no!", "maybe!")


@slow
def test_length_cut_stop_strings_and_bad_constraints(smol, tok):
    ids = chat(tok, "Describe a person as JSON.")
    out = smol.generate(ids, {"max_new_tokens": 5, "temperature": 0, "json_schema": json.dumps(PERSON)})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    out = smol.generate(ids, {"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(PERSON),
                              "stop": ['"age"']})
    assert out["meta_info"]["finish_reason"]["matched"] == '"age"'
    for params, field in (({"json_schema": "{oops"}, "json_schema"), ({"regex": "(a"}, "regex"),
                          ({"ebnf": "root ::= ("}, "ebnf"), ({"structural_tag": "[]"}, "structural_tag"),
                          ({"regex": "a", "json_schema": "{}"}, "regex"), ({"regex": 5}, "regex")):
        with pytest.raises(SamplingError) as info:
            smol.generate([ids, ids], {"max_new_tokens": 4, **params})
        assert info.value.field == field
    assert smol.generate(ids, {"max_new_tokens": 3, "temperature": 0})["meta_info"]["finish_reason"]  # serving


@slow
def test_unconstrained_rows_are_untouched_by_constrained_ones(smol, tok):
    ids = [chat(tok, "Name three colors."), chat(tok, "What is 2+2?")]
    alone = smol.generate(ids, {"max_new_tokens": 12, "temperature": 0})
    mixed = smol.generate(ids + [chat(tok, "JSON please.")], [{"max_new_tokens": 12, "temperature": 0}] * 2 + [
        {"max_new_tokens": 12, "temperature": 0, "regex": "[a-z]+"}], return_logprob=[False, False, True])
    assert [o["output_ids"] for o in mixed[:2]] == [o["output_ids"] for o in alone]
    sampled = smol.generate(ids, {"max_new_tokens": 12, "temperature": 1.0, "seed": 4})
    mixed = smol.generate(ids + [chat(tok, "JSON please.")], [{"max_new_tokens": 12, "temperature": 1.0,
                                                               "seed": 4}] * 2 + [
        {"max_new_tokens": 12, "temperature": 1.0, "seed": 9, "json_schema": "{}"}])
    assert [o["output_ids"] for o in mixed[:2]] == [o["output_ids"] for o in sampled]


@slow
def test_constraints_with_a_cartridge(smol, tok):
    spec, g = smol.spec, torch.Generator().manual_seed(0)
    shape = (1, spec.num_kv_heads, 6, spec.head_dim)
    kv = [[torch.randn(shape, generator=g) * 0.1 for _ in range(spec.num_layers)] for _ in range(2)]
    smol.load_cartridge("grammar-cart", *kv)
    try:
        outs = smol.generate([chat(tok, "Describe a person as JSON.")], {
            "max_new_tokens": 160, "json_schema": json.dumps(PERSON), "temperature": 0.7, "seed": 1},
            cartridges=["grammar-cart"])
        assert stopped(outs) and all(o["meta_info"]["cached_tokens"] == 6 for o in outs)
        for text in texts(tok, outs):
            jsonschema.validate(json.loads(text), PERSON)
    finally:
        smol.unload_cartridge("grammar-cart")


@pytest.mark.parametrize("quantization,gemv", [(None, "1"), (None, "0"), ("bf16", "1"), ("int8", "1")],
                         ids=["fp32-kernel", "fp32-torch", "bf16", "int8"])
def test_random_weights_still_give_valid_outputs(tiny_dir, tok, monkeypatch, quantization, gemv):
    """A random model follows the grammar alone: every output is valid whatever the weights, path and dtype."""
    monkeypatch.setenv("FINAL_GEMV", gemv)
    engine = EmbeddedEngine(tiny_dir, max_model_len=256, quantization=quantization)
    try:
        ids = chat(tok, "JSON")
        outs = engine.generate([ids], {"max_new_tokens": 120, "json_schema": json.dumps(COMPACT),
                                       "temperature": 1.0, "seed": 3, "n": 2})
        greedy = engine.generate([ids], {"max_new_tokens": 120, "json_schema": json.dumps(COMPACT),
                                         "temperature": 0}, return_logprob=True)
        assert stopped(outs + greedy)
        for text in texts(tok, outs + greedy):
            jsonschema.validate(json.loads(text), PERSON)
    finally:
        engine.shutdown()
