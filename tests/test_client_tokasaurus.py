"""Seed 001's client (final.client) against a real `final serve`: both protocols, cartridges, retries, metrics."""

from __future__ import annotations

import logging

import pytest

from serve_helpers import FlakyServer, build_cartridge_files, spec, start_served, stop_served
from final.client import LMConfig, RequestRejectedError, TokasaurusClient, get_lm_client
from final.errors import BackendUnavailableError, ConfigError, PromptError

pytest_plugins = ["serve_helpers"]  # the served / carts fixtures

SYSTEM, USER = "You are terse.", "Name a prime number."


def lm(url: str, **kw) -> TokasaurusClient:
    return get_lm_client({"model": "toka:tiny", "base_url": url, "temperature": 0.0, "max_output_tokens": 8,
                          "starting_delay": 0.01, **kw})


def reference(served, max_tokens: int = 8, **kw) -> str:
    return served.inference.generate([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                                     temperature=0, max_tokens=max_tokens, **kw).completions[0]


@pytest.mark.parametrize("protocol", ["openai", "toka"])
def test_call_answers_like_the_engine(served, protocol):
    with lm(served.url, protocol=protocol) as client:
        assert client.ping()
        assert client.call(SYSTEM, USER) == reference(served)
        r = client.chat([{"role": "user", "content": USER}])
        assert r.usage["completion_tokens"] > 0 and r.finish_reason in ("stop", "length") and r.latency_s > 0
        if protocol == "openai":  # token ids ride in Tokasaurus' system_fingerprint
            assert r.token_ids == served.inference.generate(USER, temperature=0, max_tokens=8).token_ids[0]


def test_stop_sequences_and_seed_001_yaml_shape(served):
    free = lm(served.url).call(SYSTEM, USER)
    stop = free.split()[1]
    cfg = LMConfig.from_dict({"model": "toka:meta-llama/Llama-3.2-3B-Instruct", "temperature": 0.0,
                              "max_output_tokens": 8, "log_calls": True, "base_url": served.url,
                              "protocol": "openai", "stop_sequences": [stop, "OBSERVATION"]})
    client = get_lm_client(cfg)
    assert client.model == "meta-llama/Llama-3.2-3B-Instruct"  # the prefix routes; the rest names the model
    cut = client.call(SYSTEM, USER)
    assert stop not in cut and free.startswith(cut)


def test_cartridges_in_the_config_and_per_call(served, tmp_path):
    carts = build_cartridge_files(served.inference, tmp_path)
    q = [{"role": "user", "content": "Who keeps the lighthouse?"}]
    per_call = lm(served.url).chat(q, cartridges=[spec(carts["a"])]).text
    configured = lm(served.url, cartridges=[spec(carts["a"])]).chat(q).text
    native = lm(served.url, protocol="toka", cartridges=[spec(carts["a"])]).chat(q).text
    served.inference.load_cartridge(path=str(carts["a"]))
    ref = served.inference.generate("Who keeps the lighthouse?", cartridge=str(carts["a"]), temperature=0,
                                    max_tokens=8).completions[0]
    assert per_call == configured == native == ref
    assert ref != lm(served.url).chat(q).text  # the cartridge changed the answer


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_retries_with_backoff_then_succeeds(served, mode, caplog):
    with FlakyServer(served.url, failures=2, mode=mode) as flaky:
        with caplog.at_level(logging.WARNING, logger="final.client"):
            assert lm(flaky.url, max_retries=2).call(SYSTEM, USER) == reference(served)
        assert flaky.calls == 3
    assert sum("retry" in r.getMessage() for r in caplog.records) == 2


def test_gives_up_with_a_clear_error(served):
    with FlakyServer(served.url, failures=5, mode="503") as flaky:
        with pytest.raises(BackendUnavailableError, match=r"after 3 attempt\(s\).*HTTP 503"):
            lm(flaky.url, max_retries=2).call(SYSTEM, USER)
        assert flaky.calls == 3


def test_4xx_is_not_retried(served):
    with FlakyServer(served.url, failures=1, mode="400") as flaky:
        with pytest.raises(RequestRejectedError):
            lm(flaky.url, max_retries=3).call(SYSTEM, USER)
        assert flaky.calls == 1
    with pytest.raises(RequestRejectedError, match="max_tokens") as exc:  # the server's own 400 names the field
        lm(served.url, max_output_tokens=10_000).call(SYSTEM, USER)
    assert exc.value.param == "max_tokens" and exc.value.status == 400
    with pytest.raises(PromptError, match="toka"):
        lm(served.url, protocol="toka").chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                              {"role": "user", "content": "c"}])


def test_metrics_are_logged_per_call(served, caplog):
    with caplog.at_level(logging.INFO, logger="final.client"):
        lm(served.url, log_calls=True).call(SYSTEM, USER)
    metrics = [r.metrics for r in caplog.records if hasattr(r, "metrics")]
    assert len(metrics) == 1
    m = metrics[0]
    assert m["latency_s"] > 0 and m["input_tokens"] > 0 and m["output_tokens"] > 0
    assert m["total_tokens"] == m["input_tokens"] + m["output_tokens"] and m["protocol"] == "openai"
    assert any(USER in r.getMessage() for r in caplog.records)  # log_calls logs the exchange


def test_api_key_is_sent():
    s = start_served(api_key="k3y")
    try:
        with pytest.raises(RequestRejectedError) as exc:
            lm(s.url).call(SYSTEM, USER)
        assert exc.value.status == 401
        assert lm(s.url, api_key="k3y").call(SYSTEM, USER)
    finally:
        stop_served(s)


@pytest.mark.parametrize("values,key", [
    ({"model": "gpt-4o"}, "lm_config.model"),
    ({"model": ""}, "lm_config.model"),
    ({"model": "toka:x", "protocol": "grpc"}, "lm_config.protocol"),
    ({"model": "toka:x", "base_url": "localhost:8080"}, "lm_config.base_url"),
    ({"model": "toka:x", "max_retries": -1}, "lm_config.max_retries"),
    ({"model": "toka:x", "max_output_tokens": 0}, "lm_config.max_output_tokens"),
    ({"model": "toka:x", "temperature": "warm"}, "lm_config.temperature"),
    ({"model": "toka:x", "stop_sequences": "STOP"}, "lm_config.stop_sequences"),
    ({"model": "toka:x", "cartridges": [{"source": "local"}]}, "lm_config.cartridges"),
    ({"model": "toka:x", "endpoint": "/x"}, "lm_config.endpoint"),
])
def test_config_errors_name_the_key(values, key):
    with pytest.raises(ConfigError) as exc:
        get_lm_client(values)
    assert exc.value.key == key
