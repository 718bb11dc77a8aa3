"""The `tokasaurus` rollout backend against a real `final serve`: the same DataProto as the local backend, with
and without cartridges; retries with backoff proven by a real HTTP server that fails its first N calls."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import torch

from conftest import tiny_config
from serve_helpers import FlakyServer, spec
from final.cartridges.build import continuation_ids
from final.client import RequestRejectedError
from final.errors import BackendUnavailableError, CartridgeError, ConfigError, SamplingError, UnsupportedError
from final.inf import InferenceEngine
from final.rollout.tokasaurus import TokasaurusSettings

pytest_plugins = ["serve_helpers"]  # the served / carts fixtures

PROMPTS = ["What is 2+2?", "Name a color.", "Tell me a joke about cats."]


def toka_engine(url: str, **custom) -> InferenceEngine:
    cfg = tiny_config(prompt_length=256, response_length=32)
    cfg["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": url, "retry_delay": 0.01, **custom})
    return InferenceEngine(cfg)


@pytest.fixture(scope="module")
def toka(served):
    with toka_engine(served.url, max_retries=0) as eng:
        yield eng


def _same_batch(a, b) -> None:
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert torch.allclose(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5)


def test_same_dataproto_as_the_local_backend(served, toka):
    def rollout(eng, **sampling):  # what InferenceEngine.generate hands to rollout.generate_sequences
        request = eng.prepare(PROMPTS, max_tokens=12, **sampling)
        data = request.dataproto(eng.pad_token_id, eng.eos_token_ids, None)
        return eng.rollout.generate_sequences(data, **request.sampling.params)

    _same_batch(rollout(toka, temperature=0), rollout(served.inference, temperature=0))
    # sampled rows are reproducible across backends too: row i is seeded seed+i on both
    _same_batch(rollout(toka, temperature=1.0, seed=7), rollout(served.inference, temperature=1.0, seed=7))
    out = toka.generate(PROMPTS, temperature=0, max_tokens=12, logprobs=True)
    ref = served.inference.generate(PROMPTS, temperature=0, max_tokens=12, logprobs=True)
    assert out.completions == ref.completions and out.token_ids == ref.token_ids
    assert out.metadata[0]["logprobs"] == pytest.approx(ref.metadata[0]["logprobs"], abs=1e-5)


def test_with_cartridges_from_the_config_and_per_row(served, carts):
    tok = served.inference.tokenizer
    q = continuation_ids(tok, "Who keeps the lighthouse?")  # ids that follow a cartridge (no BOS)
    a, b = str(carts["a"]), str(carts["b"])
    for path in (a, b):
        served.inference.load_cartridge(path=path)
    with toka_engine(served.url, cartridges=[spec(carts["a"])]) as eng:
        configured = eng.generate([q], temperature=0, max_tokens=10)  # every row gets the configured cartridge
    ref_a = served.inference.generate([q], cartridge=a, temperature=0, max_tokens=10)
    assert configured.token_ids == ref_a.token_ids
    with toka_engine(served.url, cartridges=[spec(carts["a"]), spec(carts["b"])]) as eng:
        rows = eng.generate([q, q, q, q], cartridge=[a, b, None, [a, b]], temperature=0, max_tokens=10)
        with pytest.raises(CartridgeError, match="unknown cartridge"):
            eng.generate([q], cartridge="/not/configured.pt", max_tokens=2)
    ref = served.inference.generate([q, q, q, q], cartridge=[a, b, None, [a, b]], temperature=0, max_tokens=10)
    assert rows.token_ids == ref.token_ids
    assert len({tuple(t) for t in rows.token_ids}) > 2  # A, B, none and A+B really differ


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_retries_transient_failures_with_backoff(served, mode):
    with FlakyServer(served.url, failures=2, mode=mode) as flaky, toka_engine(flaky.url, max_retries=2) as eng:
        out = eng.generate("What is 2+2?", temperature=0, max_tokens=6)
        assert flaky.calls == 3  # two failures, then the answer
    assert out.token_ids == served.inference.generate("What is 2+2?", temperature=0, max_tokens=6).token_ids


def test_clear_error_after_the_last_retry(served):
    with FlakyServer(served.url, failures=10, mode="503") as flaky, toka_engine(flaky.url, max_retries=2) as eng:
        with pytest.raises(BackendUnavailableError, match=r"after 3 attempt\(s\).*HTTP 503"):
            eng.generate("hi", max_tokens=2)
        assert flaky.calls == 3
    with socket.socket() as bound:  # a port bound and never listened on: refused, and no one else can take it
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with toka_engine(f"http://127.0.0.1:{port}", max_retries=1) as eng:
            with pytest.raises(BackendUnavailableError, match=r"after 2 attempt\(s\).*Connect"):
                eng.generate("hi", max_tokens=2)


def test_4xx_is_not_retried(served):
    with FlakyServer(served.url, failures=1, mode="400") as flaky, toka_engine(flaky.url, max_retries=3) as eng:
        with pytest.raises(RequestRejectedError, match="HTTP 400"):
            eng.generate("hi", max_tokens=2)
        assert flaky.calls == 1
    with toka_engine(served.url, max_retries=3) as eng:  # the real server's 400 names the field
        eng.rollout.update_cartridges([{"id": "/no/such.pt", "source": "local"}])
        with pytest.raises(RequestRejectedError, match="cartridges") as exc:
            eng.generate("hi", max_tokens=2)
        assert exc.value.status == 400 and exc.value.param == "cartridges"


def test_unsupported_sampling_and_lifecycle(toka):
    with pytest.raises(SamplingError, match="top_k"):
        toka.generate("hi", top_k=5, max_tokens=2)
    with pytest.raises(UnsupportedError, match="weights_dir"):  # updates go through a folder the server reads
        asyncio.run(toka.rollout.update_weights(iter([])))
    assert toka.generate("hi", max_tokens=2, temperature=0).completions  # still serving


def test_scoring_is_refused_naming_what_the_server_lacks(toka):
    with pytest.raises(UnsupportedError, match="only the generated tokens' own logprobs") as exc:
        toka.score("hi", " there")  # refused before anything is sent
    assert (exc.value.backend, exc.value.field) == ("tokasaurus", "prompt_logprobs")
    with pytest.raises(UnsupportedError) as exc:
        toka.generate("hi", max_tokens=2, top_logprobs=2)
    assert exc.value.field == "top_logprobs"
    with pytest.raises(UnsupportedError, match="no prompt"):  # veRL-style callers reach the engine the same way
        toka.rollout.engine.submit_generate([[1, 2]], {"max_new_tokens": 1}, logprob_start_len=0)
    assert toka.generate("hi", max_tokens=2, temperature=0).completions  # still serving


@pytest.mark.parametrize("custom,key", [
    ({"tokasaurus_url": "localhost:10210"}, "rollout.custom.tokasaurus_url"),
    ({"max_retries": -1}, "rollout.custom.max_retries"),
    ({"max_retries": 1.5}, "rollout.custom.max_retries"),
    ({"base_timeout": 0}, "rollout.custom.base_timeout"),
    ({"base_timeout": "fast"}, "rollout.custom.base_timeout"),
    ({"retry_delay": -1}, "rollout.custom.retry_delay"),
    ({"max_retry": 3}, "rollout.custom.max_retry"),
    ({"cartridges": {"id": "x"}}, "rollout.custom.cartridges"),
    ({"cartridges": [{"source": "local"}]}, "rollout.custom.cartridges[0].id"),
    ({"cartridges": [{"id": "x", "source": "ftp"}]}, "rollout.custom.cartridges[0].source"),
    ({"cartridges": [{"id": "x", "force_redownload": "yes"}]}, "rollout.custom.cartridges[0].force_redownload"),
    ({"cartridges": [{"id": "x", "path": "y"}]}, "rollout.custom.cartridges[0].path"),
])
def test_config_errors_name_the_key(custom, key):
    with pytest.raises(ConfigError) as exc:
        TokasaurusSettings.from_custom(custom)
    assert exc.value.key == key


def test_seed_000_config_and_defaults():
    s = TokasaurusSettings.from_custom({"tokasaurus_url": "http://localhost:10210/", "max_retries": 5,
                                        "base_timeout": 120, "cartridges": [
                                            {"id": "/tmp/cartridge.pt", "source": "local", "force_redownload": True}]})
    assert (s.url, s.max_retries, s.base_timeout, s.retry_delay) == ("http://localhost:10210", 5, 120.0, 2.0)
    assert s.cartridges == [{"id": "/tmp/cartridge.pt", "source": "local", "force_redownload": True}]
    assert TokasaurusSettings.from_custom({}).url == "http://localhost:10210"
    cfg = tiny_config()
    cfg["rollout"].update(name="tokasaurus", custom={"max_retries": -3})
    with pytest.raises(ConfigError, match="max_retries"):
        InferenceEngine(cfg)


def test_final_serve_on_the_tokasaurus_backend(served, toka):
    """`final serve` on a non-local backend answers through InferenceEngine.agenerate (here: a proxy chain)."""
    import openai

    from final.server.app import ServerThread, create_app

    with ServerThread(create_app(toka)) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
        direct = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
        assert client.chat.completions.create(**kw).choices[0].message.content == \
            direct.chat.completions.create(**kw).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                  if c.choices]
        assert "".join(pieces) == direct.chat.completions.create(**kw).choices[0].message.content
        refused = httpx.post(f"{proxy.url}/custom/cartridge/completions", timeout=60, json={
            "model": "m", "prompt": "hi", "max_tokens": 2, "cartridges": [{"id": "x", "source": "local"}]})
        assert refused.status_code == 400 and "no cartridges" in refused.json()["error"]["message"]


def test_a_calls_own_tools_on_the_tokasaurus_backend(served, toka):
    """Per-call tools on Tokasaurus: offered and parsed as on the local backend (same prompt, same answer);
    max_turns runs the loop over HTTP where rollout.calculate_log_probs is off, and is refused (naming the backend
    and the field) where it is on, since the loop's scoring pass needs prompt logprobs the server does not give."""
    from tools_helpers import get_weather

    out = toka.generate(PROMPTS[:1], tools=[get_weather], temperature=0, max_tokens=12)
    ref = served.inference.generate(PROMPTS[:1], tools=[get_weather], temperature=0, max_tokens=12)
    def without_ids(message: dict) -> dict:  # call ids are unique per answer
        return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}

    assert out.token_ids == ref.token_ids and out.completions == ref.completions
    assert without_ids(out.metadata[0]["message"]) == without_ids(ref.metadata[0]["message"])
    with pytest.raises(UnsupportedError) as exc:
        toka.generate(PROMPTS[:1], tools=[get_weather], max_turns=2, max_tokens=4)
    assert exc.value.backend == "tokasaurus" and exc.value.field == "max_turns"
    with pytest.raises(UnsupportedError) as exc:  # the constraint tool_choice required needs, named as asked
        toka.prepare(PROMPTS[:1], tools=[get_weather], tool_choice="required")
    assert exc.value.backend == "tokasaurus" and exc.value.field == "tool_choice"
    cfg = tiny_config(prompt_length=256, response_length=32, calculate_log_probs=False)
    cfg["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": served.url, "max_retries": 0})
    with InferenceEngine(cfg) as loop:
        events = []
        looped = loop.generate(PROMPTS[:1], tools=[get_weather], max_turns=2, temperature=0, max_tokens=8,
                               on_event=events.append)
        system = looped.metadata[0]["messages"][0]  # the fallback prompt: the tiny model's ChatML renders no tools
        assert system["role"] == "system" and '"name": "get_weather"' in system["content"]
        assert events[0]["type"] == "assistant" and events[-1]["type"] == "done"
