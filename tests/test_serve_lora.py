"""LoRA adapters through `final serve --lora NAME=DIR` and `final generate --lora`: the openai SDK picks an adapter
by the `model` field (as vLLM and SGLang serve them) and gets what the engine gives for that adapter, /v1/models
lists them under the served model, an unknown model is a 404; the tokasaurus backend refuses per-request adapters
by name and sends a trainer's adapter to its server merged."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from conftest import TINY, tiny_config
from lora_helpers import ADAPTERS, hf_rows, peft_model, write_adapter
from serve_helpers import spawn_serve, stop_serve

MAX = 10
Q = "What is the capital of France?"


@pytest.fixture(scope="module")
def folders(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(tiny_dir, root / name, seed, **ADAPTERS[name])
            for seed, name in enumerate(["all", "qvd"], 1)}


@pytest.fixture(scope="module")
def reference(folders):
    """The same adapters on an in-process engine: what the server must answer."""
    from final.inf import InferenceEngine

    with InferenceEngine(tiny_config(prompt_length=256, response_length=32)) as eng:
        eng.load_adapter(folders["all"], name="all")
        eng.load_adapter(folders["qvd"])
        yield eng


@pytest.fixture(scope="module")
def url(folders, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("serve") / "config.yaml"
    cfg.write_text(f"model_path: {TINY}\nprogress: false\n"
                   "rollout: {name: local, prompt_length: 256, response_length: 32}\n")
    url, proc = spawn_serve("--config", str(cfg), "--lora", f"all={folders['all']}", "--lora", folders["qvd"])
    yield url
    stop_serve(proc)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_adapters_under_the_served_model(client):
    models = {m.id: m for m in client.models.list()}
    assert list(models) == [TINY, "all", "qvd"]
    assert models["all"].model_extra["parent"] == TINY and models["qvd"].model_extra["parent"] == TINY


@pytest.mark.parametrize("model", ["all", "qvd", TINY])
def test_the_model_field_picks_the_adapter(client, reference, model):
    adapter = {} if model == TINY else {"adapter": model}
    want = reference.generate("Once upon a time", raw=True, temperature=0, max_tokens=MAX, **adapter)
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=MAX, temperature=0)
    assert out.choices[0].text == want.completions[0] and out.model == model
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": Q}], max_tokens=MAX,
                                          temperature=0)
    assert chat.choices[0].message.content == reference.generate(Q, temperature=0, max_tokens=MAX,
                                                                 **adapter).completions[0]


def test_adapters_change_the_answer_and_streams_keep_them(client, reference):
    texts = {m: reference.generate(Q, temperature=0, max_tokens=MAX, **({"adapter": m} if m else {})).completions[0]
             for m in (None, "all", "qvd")}
    assert len(set(texts.values())) == 3
    stream = client.chat.completions.create(model="qvd", messages=[{"role": "user", "content": Q}],
                                            max_tokens=MAX, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == texts["qvd"]


def test_an_unknown_model_is_a_404_naming_the_served_ones(client, url):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model" and "'all'" in body["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "a\x00", "messages": [{"role": "user",
                                                                                         "content": "hi"}]})
    assert r.status_code == 404
    assert client.completions.create(model="all", prompt="hi", max_tokens=2).choices  # still serving


def test_final_generate_takes_lora(folders, reference):
    cmd = [sys.executable, "-m", "final.cli", "generate", "--model", TINY, "--lora", f"x={folders['qvd']}",
           "--max-tokens", str(MAX), "--temperature", "0", "--json", Q]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)["completions"]
    assert got == reference.generate(Q, temperature=0, max_tokens=MAX, adapter="qvd").completions
    two = subprocess.run(cmd[:6] + ["--lora", folders["all"]] + cmd[6:], capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 2 and "--adapter" in two.stderr  # two adapters: which one is for the prompts?


def test_the_tokasaurus_backend_refuses_per_request_adapters_and_merges_a_trainers(tiny_dir, tmp_path):
    from final.errors import UnsupportedError
    from final.inf import InferenceEngine
    from final.server.app import ServerThread, create_app

    with InferenceEngine(tiny_config(prompt_length=128, response_length=16)) as inference, \
            ServerThread(create_app(inference, weights_dir=str(tmp_path))) as thread:
        cfg = tiny_config(prompt_length=128, response_length=16)
        cfg["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": thread.url, "max_retries": 0,
                                                         "weights_dir": str(tmp_path / "staging")})
        with InferenceEngine(cfg) as toka:
            with pytest.raises(UnsupportedError, match="Tokasaurus") as err:
                toka.generate("hi", adapter="all")
            assert err.value.backend == "tokasaurus" and err.value.field == "adapter"
            model = peft_model(tiny_dir, 4, **ADAPTERS["qvd"])
            assert toka.update_weights(model) == 1  # merged here, sent as the adapted modules' weights
            ids = toka.prepare(["hello", Q]).ids
            want = [tokens for tokens, _ in hf_rows(model, ids, MAX, toka.eos_token_ids[0])]
            assert toka.generate(["hello", Q], temperature=0, max_tokens=MAX).token_ids == want
