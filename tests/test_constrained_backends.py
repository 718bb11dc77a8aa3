"""Constraint keys through InferenceEngine (local backend, tiny model) and what the other backends say to them:
the SGLang lanes and Tokasaurus refuse each key with an UnsupportedError naming the backend, the field and what
would serve it, before any work."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import tiny_config
from final import compat
from final.errors import SamplingError, UnsupportedError
from final.inf import InferenceEngine
from final.rollout.base import Capabilities
from final.rollout.sglang.config import refuse_constraints
from final.rollout.tokasaurus import TokasaurusRollout
from final.sampling import CONSTRAINT_KEYS, parse_sampling

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"], "x-guidance": {
    "whitespace_flexible": False}, "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 99}}}
VALUES = {"json_schema": SCHEMA, "regex": "[a-z]{3}", "ebnf": 'root ::= "a"', "structural_tag": {
    "type": "structural_tag", "format": {"type": "const_string", "value": "a"}}}


def test_generate_takes_constraints_as_text_or_objects(tiny_inference):
    out = tiny_inference.generate(["Hi", "JSON please"], json_schema=SCHEMA, n=2, seed=3, max_tokens=16)
    assert len(out.completions) == 4
    for text in out.completions:
        jsonschema.validate(json.loads(text), SCHEMA)
    out = tiny_inference.generate("Hi", regex="(yes|no)[0-9]", temperature=0, max_tokens=4)
    assert out.completions[0][:-1] in ("yes", "no") and out.completions[0][-1].isdigit()
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "A: "}, {"type": "regex", "pattern": "[0-9]{2}"}]}}
    out = tiny_inference.generate("Hi", structural_tag=json.dumps(tag), temperature=0, max_tokens=8)
    assert out.completions[0][:3] == "A: " and out.completions[0][3:].isdigit()


@pytest.mark.parametrize("sampling,field", [
    ({"json_schema": "{", "max_tokens": 4}, "json_schema"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"ebnf": "root ::= ("}, "ebnf"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "dispatch"}}}, "structural_tag"),
    ({"json_schema": SCHEMA, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_typed_errors_and_the_engine_keeps_serving(tiny_inference, sampling, field):
    with pytest.raises(SamplingError) as info:
        tiny_inference.generate(["Hi", "Ho"], **sampling)
    assert info.value.field == field
    assert tiny_inference.generate("Hi", max_tokens=2, temperature=0).completions


def test_limits_bound_the_constraint_text():
    with InferenceEngine({**tiny_config(), "limits": {"max_grammar_bytes": 64}}) as engine:
        with pytest.raises(SamplingError, match="max_grammar_bytes") as info:
            engine.generate("Hi", regex="a" * 100)
        assert info.value.field == "regex"


@pytest.mark.parametrize("key", CONSTRAINT_KEYS)
def test_tokasaurus_refuses_constraints_naming_what_serves_them(key):
    parsed = parse_sampling({key: VALUES[key]}, response_length=8)
    with pytest.raises(UnsupportedError) as info:
        TokasaurusRollout.capabilities.check("tokasaurus", parsed)
    assert info.value.field == key and "rollout.name: local" in str(info.value)
    Capabilities(sampling_keys=TokasaurusRollout.capabilities.sampling_keys).check(
        "tokasaurus", parse_sampling({"max_tokens": 4}, response_length=8))


@pytest.mark.parametrize("key", CONSTRAINT_KEYS)
def test_sglang_lanes_refuse_constraints_naming_the_lane(key):
    with pytest.raises(UnsupportedError) as info:
        refuse_constraints({key: "x", "temperature": 1.0})
    assert info.value.field == key and compat.LANE in str(info.value) and "rollout.name: local" in str(info.value)
    refuse_constraints({"temperature": 1.0, key: None})
    if compat.LANE == "verl06":
        from final.rollout.sglang.rollout_052 import SGLangRollout

        caps = SGLangRollout.capabilities
    else:
        from final.rollout.sglang.rollout_0512 import DirectSGLangRollout

        caps = DirectSGLangRollout.capabilities
    with pytest.raises(UnsupportedError, match="grammar"):
        caps.check("sglang", parse_sampling({key: VALUES[key]}, response_length=8))
