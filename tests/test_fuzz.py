"""Fuzzing every entry point (issue 13): malformed HTTP bodies, Python calls, config.yaml and tools.yaml files,
cartridge files and tool calls written by the model. Each must be refused with a typed error (4xx JSON over HTTP)
that names its cause, and a good request must succeed right after it. Hand-picked cases cover what is known to
bite (non-finite floats, huge integers, wrong content types, invalid UTF-8, deep nesting, pickles with code);
hypothesis generates more, derandomized so every run tries the same inputs. COUNTS tallies what was tried."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_config
from final.cartridges.format import CartridgeKV, save_cartridge
from final.config import load_config
from final.errors import CartridgeError, ConfigError, FinalError, PromptError, SamplingError, ToolConfigError
from final.inf import InferenceEngine
from final.server.app import ServerThread, create_app
from final.tools.executor import ToolExecutor
from final.tools.parser import ToolCallParser
from final.tools.registry import load_tools
from multiturn_tools import schema

COUNTS: collections.Counter = collections.Counter()
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GOOD = {"model": "m", "prompt": [1, 504, 3458], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def inference():
    eng = InferenceEngine({**tiny_config(prompt_length=64, response_length=8), "limits": {"max_body_bytes": 65536}})
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def http(inference, folder):
    with ServerThread(create_app(inference, cartridge_dir=str(folder))) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _refused(resp: httpx.Response, http: httpx.Client, *, param: str | None = None, words: str = "",
             kind: str = "http") -> dict:
    """A 4xx with an OpenAI error body naming the cause, then a good request answered."""
    assert 400 <= resp.status_code < 500, resp.text[:500]
    err = resp.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:  # the field, or a path inside it (prompt.0)
        assert err["param"] == param or str(err["param"]).startswith(f"{param}."), err
    assert words.lower() in err["message"].lower(), err
    assert http.post("/v1/completions", json=GOOD).status_code == 200
    COUNTS[kind] += 1
    return err


def _post(http: httpx.Client, body, path: str = "/v1/completions") -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return http.post(path, content=raw, headers={"content-type": "application/json"})


# ---- HTTP bodies -------------------------------------------------------------------------------------------------
FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", FLOATS)
def test_http_nonfinite_floats(http, field, value):
    _refused(_post(http, {**GOOD, field: value}), http, param=field, words="finite")


@pytest.mark.parametrize("field,value", [("top_logprobs", 21), ("top_logprobs", -1), ("top_logprobs", 10**30),
                                         ("logprobs", "yes")])
def test_http_chat_logprob_fields(http, field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
            field: value}
    _refused(_post(http, body, "/v1/chat/completions"), http, param=field)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_http_nonfinite_temperature_on_chat_and_generate(http, path, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": value} \
        if "chat" in path else {"prompt": "hi", "temperature": value}
    _refused(_post(http, body, path), http, param="temperature", words="finite")


HUGE = [("n", 10**30), ("max_tokens", 10**30), ("seed", 10**30), ("top_k", 10**30), ("temperature", 1e308),
        ("top_k", 2**40), ("n", 10**4000), ("logprobs", 10**30), ("repetition_penalty", 1e-300),
        ("stop", ["x" * 5000])]


@pytest.mark.parametrize("field,value", HUGE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HUGE)])
def test_http_huge_values(http, field, value):
    _refused(_post(http, {**GOOD, field: value}), http, param=field)


WRONG = [("prompt", {}), ("prompt", [1.5]), ("prompt", [[1, "a"]]), ("prompt", [-1]), ("prompt", [10**12]),
         ("stream", "yes"), ("stop", 5), ("stop", [1, 2]), ("n", 1.5), ("max_tokens", "8"), ("seed", "1"),
         ("top_k", 0), ("top_k", -2), ("top_p", 1.5), ("temperature", -0.1), ("min_p", 2), ("n", -1),
         ("presence_penalty", 3), ("max_tokens", -5), ("logprobs", -1), ("model", 5), ("user", ["u"]),
         ("stream_options", {"include_usage": "x"}), ("ignore_eos", 1), ("echo", "yes"), ("logprobs", 21),
         ("logprobs", True)]


@pytest.mark.parametrize("field,value", WRONG, ids=[f"{f}-{i}" for i, (f, _) in enumerate(WRONG)])
def test_http_wrong_types_and_ranges(http, field, value):
    _refused(_post(http, {**GOOD, field: value}), http, param=field)


RAW = [(b"", "json"), (b"{", "json"), (b'{"model": "m", "prompt": [1, 2', "json"), (b"[1, 2]", ""),
       (b'"text"', ""), (b"null", ""), (b"42", ""), (b'{"model":"m","prompt":"\xff\xfe"}', "json"),
       (b'{"model":"m","prompt":"\\ud800"}', ""), (b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), "json"),
       (json.dumps({**GOOD, "prompt": [[[[[[1]]]]]]}).encode(), ""),
       (b'{"model":"m","prompt":' + b"[" * 20000 + b"]" * 20000 + b"}", "json"),
       (b'{"model":"m","prompt":"hi","metadata":' + b'{"a":' * 5000 + b"1" + b"}" * 5001, "json")]


@pytest.mark.parametrize("raw,words", RAW, ids=[f"raw-{i}" for i in range(len(RAW))])
def test_http_invalid_json_utf8_and_nesting(http, raw, words):
    _refused(_post(http, raw), http, words=words)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/xml"])
def test_http_wrong_content_types(http, ctype):
    resp = http.post("/v1/completions", content=json.dumps(GOOD), headers={"content-type": ctype})
    assert resp.status_code == 415
    _refused(resp, http, param="content-type")


def test_http_huge_bodies(http):
    _refused(_post(http, {**GOOD, "prompt": "word " * 20000}), http, words="max_body_bytes")
    _refused(http.post("/v1/completions", content=(b" " * 8192 for _ in range(10))), http, words="max_body_bytes")


def _bad_value(field: str):
    """Values that are never valid for `field`: wrong JSON types, non-finite or out-of-range numbers."""
    junk = st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.booleans())
    if field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        high = {"temperature": 1e6, "top_p": 1.0, "min_p": 1.0}.get(field, 2.0)
        low = {"presence_penalty": -2.0, "frequency_penalty": -2.0}.get(field, 0.0)
        nums = st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(
            lambda x: not math.isfinite(x) or x > high or x < low or (field == "top_p" and x == 0)),
            st.sampled_from([math.nan, math.inf, -math.inf]))
        return st.one_of(junk, nums)
    if field == "n":
        return st.one_of(junk, st.integers(max_value=0), st.integers(min_value=65, max_value=10**40),
                         st.floats(allow_nan=True))
    return st.one_of(junk.filter(lambda v: not isinstance(v, int)), st.integers(max_value=0),
                     st.integers(min_value=10**6, max_value=10**40))  # max_tokens


@FUZZ
@given(data=st.data())
def test_http_fuzzed_fields(http, data):
    field = data.draw(st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                       "n", "max_tokens"]))
    value = data.draw(_bad_value(field))
    _refused(_post(http, {**GOOD, field: value}), http, param=field, kind="http-hypothesis")


# ---- the Python API ----------------------------------------------------------------------------------------------
PY = [({"temperature": math.nan}, SamplingError, "temperature"), ({"top_p": math.inf}, SamplingError, "top_p"),
      ({"n": 10**6}, SamplingError, "n"), ({"n": 10**5000}, SamplingError, "n"),
      ({"stop": ["s"] * 10000}, SamplingError, "stop"), ({"stop": [""]}, SamplingError, "stop"),
      ({"stop_token_ids": [10**9]}, SamplingError, "stop_token_ids"), ({"seed": 2**70}, SamplingError, "seed"),
      ({"top_k": 2**40}, SamplingError, "top_k"), ({"repetition_penalty": 1e-39}, SamplingError, "repetition"),
      ({"min_new_tokens": 10**6}, SamplingError, "min_new_tokens"), ({"logprobs": "yes"}, SamplingError, "logprobs"),
      ({"max_tokens": 10**30}, SamplingError, "max_tokens"), ({"bogus": 1}, SamplingError, "bogus"),
      ({"temperature": "hot"}, SamplingError, "temperature")]


@pytest.mark.parametrize("kwargs,error,words", PY, ids=[f"py-{i}" for i in range(len(PY))])
def test_python_sampling(inference, kwargs, error, words):
    with pytest.raises(error, match=words):
        inference.generate("hi", **kwargs)
    _good_python(inference)


PROMPTS = [None, 5, [], [[]], [[-1]], [[10**9]], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
           "word " * 400, [[1, "a"]], b"bytes", [{"role": "user", "content": 5}], {"prompt": "x"}]


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"prompt-{i}" for i in range(len(PROMPTS))])
def test_python_prompts(inference, prompt):
    with pytest.raises(PromptError):
        inference.generate(prompt)
    _good_python(inference)


def test_python_other_arguments(inference):
    for kwargs, error in (({"cartridge": 5}, CartridgeError), ({"cartridge": "nope"}, CartridgeError),
                          ({"tools_kwargs": {"x": {}}}, ConfigError),
                          ({"cartridge": [{"id": "x", "source": "ftp"}]}, CartridgeError)):
        with pytest.raises(error):
            inference.generate("hi", **kwargs)
        _good_python(inference)


@FUZZ
@given(data=st.data())
def test_python_fuzzed_sampling(inference, data):
    field = data.draw(st.sampled_from(["temperature", "top_p", "min_p", "presence_penalty", "n", "max_tokens"]))
    value = data.draw(_bad_value(field))
    with pytest.raises(SamplingError) as err:
        inference.generate("hi", **{field: value})
    assert err.value.field in (field, "max_tokens"), err.value
    _good_python(inference, kind="python-hypothesis")


def _good_python(inference: InferenceEngine, kind: str = "python") -> None:
    assert inference.generate([[1, 504]], max_tokens=1).metadata[0]["completion_tokens"] == 1
    COUNTS[kind] += 1


# ---- config.yaml -------------------------------------------------------------------------------------------------
CONFIGS = [("rollout: {temperature: .nan}", "rollout.temperature"), ("rollout: {top_p: .inf}", "rollout.top_p"),
           ("rollout: {top_k: 1099511627776}", "rollout.top_k"), ("rollout: {gpu_memory_utilization: .nan}",
                                                                  "rollout.gpu_memory_utilization"),
           ("rollout: {val_kwargs: {temperature: -.inf}}", "rollout.val_kwargs.temperature"),
           ("rollout: {repetition_penalty: 0.0}", "rollout.repetition_penalty"),
           ("rollout: {prompt_length: -1}", "rollout.prompt_length"), ("rollout: {response_length: x}",
                                                                        "rollout.response_length"),
           ("rollout: {promt_length: 5}", "rollout.promt_length"), ("rollout: [1, 2]", "rollout"),
           ("limits: {max_n: 0}", "limits.max_n"), ("limits: {deadline_s: .inf}", "limits.deadline_s"),
           ("limits: {max_body_bytes: 1.5}", "limits.max_body_bytes"), ("limits: {max_nn: 3}", "limits.max_nn"),
           ("limits: 5", "limits"), ("cartridges: [5]", "cartridges[0]"), ("progress: maybe", "progress"),
           ("replicas: .nan", "replicas"), ("rollout: {name: vllm}", "rollout.name"),
           ("model_path: 5", "model_path")]
BROKEN = [b"model_path: [", b"\xff\xfe\x00garbage", b"a: " + b"[" * 5000, b"date: 2020-13-45", b"- a list",
          b"", b"\x00\x01\x02", b"model_path: !!python/object:os.system x", b"a: &x [*x]\nmodel_path: *x"]


@pytest.mark.parametrize("text,key", CONFIGS, ids=[c[1] + f"-{i}" for i, c in enumerate(CONFIGS)])
def test_config_files(inference, folder, text, key):
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump({"model_path": "builtin:tiny-random-llama", **yaml.safe_load(text)}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key and str(path) in str(err.value)
    _good_python(inference, kind="config")


@pytest.mark.parametrize("raw", BROKEN, ids=[f"broken-{i}" for i in range(len(BROKEN))])
def test_config_files_that_are_not_configs(inference, folder, raw):
    path = folder / "broken.yaml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(path)
    _good_python(inference, kind="config")


# ---- tools.yaml --------------------------------------------------------------------------------------------------
def _tool(**extra) -> dict:
    return {"class_name": "multiturn_tools.EchoTool", "config": {"type": "native"}, "tool_schema": schema("echo"),
            **extra}


TOOLS = [("timeout_s: .nan", "tools[0].timeout_s"), ("timeout_s: .inf", "tools[0].timeout_s"),
         ("timeout_s: -1", "tools[0].timeout_s"), ("timeout_s: soon", "tools[0].timeout_s"),
         ("timeout_s: true", "tools[0].timeout_s"), ("class_name: 5", "tools[0].class_name"),
         ("class_name: os.system", "tools[0].class_name"), ("config: {type: mcp}", "tools[0].config.type")]


@pytest.mark.parametrize("line,key", TOOLS, ids=[f"tools-{i}" for i in range(len(TOOLS))])
def test_tools_files(inference, folder, line, key):
    entry = _tool()
    entry.update(yaml.safe_load(line))
    path = folder / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [entry]}))  # NaN and inf are written .nan and .inf
    with pytest.raises(ToolConfigError) as err:
        load_tools(path)
    assert err.value.key == key
    _good_python(inference, kind="tools")


@pytest.mark.parametrize("raw", [b"tools: [", b"\xff\xfe", b"tools: " + b"[" * 5000, b"tools: {}", b"tools: [5]",
                                 b"x: 1"], ids=[f"tools-raw-{i}" for i in range(6)])
def test_tools_files_that_are_not_tools(inference, folder, raw):
    path = folder / "tools-raw.yaml"
    path.write_bytes(raw)
    with pytest.raises(ToolConfigError, match="tools"):
        load_tools(path)
    _good_python(inference, kind="tools")


# ---- cartridge files ---------------------------------------------------------------------------------------------
class _Evil:
    """Pickles as a call of os.system: loading it unsafely would write `target`."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.target}",))


def _cart(inference: InferenceEngine, tokens: int = 4, dtype=torch.float32, heads: int | None = None) -> CartridgeKV:
    spec = inference.engine.spec
    shape = (1, heads or spec.num_kv_heads, tokens, spec.head_dim)
    return CartridgeKV([torch.randn(shape).to(dtype) for _ in range(spec.num_layers)],
                       [torch.randn(shape).to(dtype) for _ in range(spec.num_layers)], 1)


def _cartridge_files(inference: InferenceEngine, folder: Path) -> list[tuple[Path, str]]:
    """(file, a word its error must contain)."""
    good = save_cartridge(_cart(inference), folder / "good.pt")
    safe = save_cartridge(_cart(inference), folder / "good.safetensors")
    nan, inf = _cart(inference), _cart(inference)
    nan.values[1][0, 0, 1, 1] = math.nan
    inf.keys[0][0, 0, 0, 0] = math.inf
    files = [(folder / "trunc.pt", "truncated"), (folder / "trunc.safetensors", "safetensors"),
             (folder / "random.pt", "cartridge"), (folder / "random.safetensors", "cartridge"),
             (folder / "empty.pt", "empty"), (folder / "evil.pt", "unpickle"), (folder / "pickled.pt", "pickle"),
             (save_cartridge(nan, folder / "nan.pt"), "NaN"), (save_cartridge(inf, folder / "inf.safetensors"), "NaN"),
             (save_cartridge(_cart(inference, heads=7), folder / "heads.pt"), "num_kv_heads"),
             (save_cartridge(_cart(inference, dtype=torch.float16).to(torch.float16), folder / "half.pt"), ""),
             (folder / "ints.pt", "dtype"), (folder / "shape3d.pt", "shape"), (folder / "list.pt", "dict")]
    (folder / "trunc.pt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (folder / "trunc.safetensors").write_bytes(safe.read_bytes()[:100])
    (folder / "random.pt").write_bytes(os.urandom(4096))
    (folder / "random.safetensors").write_bytes(os.urandom(4096))
    (folder / "empty.pt").write_bytes(b"")
    torch.save({"trainable_keys": [_Evil(folder / "pwned")], "trainable_values": []}, folder / "evil.pt")
    (folder / "pickled.pt").write_bytes(pickle.dumps({"trainable_keys": _Evil(folder / "pwned")}))
    ints = _cart(inference).split()
    torch.save({k: [t.to(torch.int64) for t in v] for k, v in ints.items()}, folder / "ints.pt")
    torch.save({k: [t[0] for t in v] for k, v in _cart(inference).split().items()}, folder / "shape3d.pt")
    torch.save([1, 2, 3], folder / "list.pt")
    return [f for f in files if f[0].name != "half.pt"]


def test_cartridge_files(inference, http, folder):
    """Over HTTP (a file under --cartridge-dir: 400 naming cartridges) and from Python (CartridgeError)."""
    for path, words in _cartridge_files(inference, folder):
        body = {**GOOD, "cartridges": [{"id": path.name, "source": "local"}]}
        err = _refused(http.post("/custom/cartridge/completions", json=body), http, param="cartridges",
                       kind="cartridge-http")
        assert words.lower() in err["message"].lower(), (path.name, err)
        with pytest.raises(CartridgeError) as caught:
            inference.load_cartridge(path=str(path))
        assert caught.value.file and words.lower() in str(caught.value).lower()
        _good_python(inference, kind="cartridge-python")
    assert not (folder / "pwned").exists()  # the pickled code never ran
    assert inference.cartridge_ids() == []


# ---- tool calls written by the model -----------------------------------------------------------------------------
CALLS = ["<tool_call>", "<tool_call>{</tool_call>", "<tool_call>[]</tool_call>", "<tool_call>5</tool_call>",
         '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"name": "echo", "arguments": "x"}</tool_call>',
         '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>" + "[" * 50000 + "</tool_call>",
         '<tool_call>{"name": "echo", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
         '<tool_call>{"name": "echo", "arguments": {"a": NaN}}</tool_call>', "<tool_call>\x00\xff</tool_call>",
         '<tool_call>{"name": "", "arguments": {}}</tool_call>', "<tool_call></tool_call><tool_call>",
         '<tool_call>{"name": "echo", "arguments": {}}</tool_call>' * 3]


@pytest.fixture(scope="module")
def executor(folder):
    path = folder / "echo-tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [_tool()]}))
    return ToolExecutor(load_tools(path), max_parallel_calls=1, max_response_length=64)


def _run_calls(executor: ToolExecutor, text: str) -> list:
    parsed = ToolCallParser("hermes").parse(text)
    outcomes = asyncio.run(executor.execute_turn("fuzz", parsed.calls, {}, 1))
    assert len(outcomes) == len(parsed.calls)
    for call, outcome in zip(parsed.calls, outcomes):  # every refused call names why, as the tool's answer
        assert outcome.executed or outcome.response.text.startswith("Error: ")
        assert call.ok or outcome.trace["error"]
    return outcomes


@pytest.mark.parametrize("text", CALLS, ids=[f"call-{i}" for i in range(len(CALLS))])
def test_malformed_tool_calls(inference, executor, text):
    outcomes = _run_calls(executor, text)
    assert outcomes and not all(o.executed for o in outcomes)  # something in each was refused
    _good_python(inference, kind="tool-call")


@FUZZ
@given(body=st.one_of(st.text(max_size=60), st.recursive(st.none() | st.booleans() | st.integers() | st.text(
    max_size=5), lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8).map(json.dumps)))
def test_fuzzed_tool_calls(executor, body):
    _run_calls(executor, f"<tool_call>{body}</tool_call>")
    COUNTS["tool-call-hypothesis"] += 1


def test_fuzz_covered_at_least_150_inputs():
    """Runs last: the module's tally (a subset run by -k proves nothing)."""
    if len(COUNTS) < 8:
        pytest.skip("only part of the fuzz module ran")
    print(dict(COUNTS), sum(COUNTS.values()))
    assert sum(COUNTS.values()) >= 150, COUNTS
