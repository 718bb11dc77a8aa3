"""The redesign's promises, end to end on real engines and real HTTP servers on 127.0.0.1:
one result record (generate() and `final serve` report the same finish reason and token counts), requests a
backend cannot serve are refused before any work, `final eval` runs through InferenceEngine on any backend, and
the CLI works from a folder with no config.yaml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import tiny_config
from serve_helpers import DOC_A, FlakyServer, spec, start_served, stop_served
from final.errors import UnsupportedError
from final.inf import InferenceEngine

pytest_plugins = ["serve_helpers"]  # the served / carts fixtures
ROOT = Path(__file__).resolve().parents[1]


def _stop_string(inference) -> str:
    """A stop string the tiny model's greedy answer to 'hi' really produces (its 3rd token's text)."""
    out = inference.generate("hi", temperature=0, max_tokens=8)
    ids = out.token_ids[0]
    return inference.tokenizer.decode(ids[2:3]).strip() or inference.tokenizer.decode(ids[2:4])


def test_stop_string_is_stop_in_generate_and_over_http(served):
    inference = served.inference
    stop = _stop_string(inference)
    out = inference.generate("hi", temperature=0, max_tokens=8, stop=[stop])
    meta = out.metadata[0]
    assert meta["finish_reason"] == "stop" and meta["matched"] == stop and stop not in out.completions[0]
    body = httpx.post(f"{served.url}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "stop": [stop]}, timeout=60).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == out.completions[0]
    assert body["usage"]["prompt_tokens"] == meta["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == meta["completion_tokens"]


def test_prompt_tokens_agree_with_a_cartridge(served, carts):
    inference = served.inference
    cid = inference.load_cartridge(path=str(carts["a"]))
    try:
        meta = inference.generate("Who keeps the lighthouse?", cartridge=cid, temperature=0, max_tokens=4).metadata[0]
        body = httpx.post(f"{served.url}/custom/cartridge/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "Who keeps the lighthouse?"}], "max_tokens": 4,
            "temperature": 0, "cartridges": [spec(cid)]}, timeout=60).json()
        usage = body["usage"]
        assert usage["prompt_tokens"] == meta["prompt_tokens"] > meta["cached_tokens"] > 0
        assert usage["prompt_tokens_details"]["cached_tokens"] == meta["cached_tokens"]
    finally:
        inference.unload_cartridge(cid)


def test_what_a_backend_cannot_serve_is_refused_before_any_request(served):
    with FlakyServer(served.url, failures=0) as proxy:
        cfg = tiny_config(prompt_length=256, response_length=32)
        cfg["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": proxy.url})
        with InferenceEngine(cfg) as toka:
            for kwargs, field in (({"top_k": 5}, "top_k"), ({"min_p": 0.1}, "min_p"),
                                  ({"repetition_penalty": 1.2}, "repetition_penalty")):
                with pytest.raises(UnsupportedError, match="tokasaurus") as exc:
                    toka.generate("hi", max_tokens=2, **kwargs)
                assert exc.value.field == field and exc.value.backend == "tokasaurus"
            assert proxy.calls == 0  # nothing was sent
            assert toka.generate("hi", max_tokens=2, top_k=-1).completions  # a no-op value is fine
            assert proxy.calls == 1


def test_capabilities_name_backend_and_field():
    from final.rollout.base import BASIC_KEYS, Capabilities
    from final.sampling import parse_sampling

    caps = Capabilities(seed=False, stop_strings=False, sampling_keys=BASIC_KEYS)
    for sampling, field in (({"seed": 1}, "seed"), ({"stop": ["x"]}, "stop"), ({"top_k": 3}, "top_k")):
        with pytest.raises(UnsupportedError, match=f"'{field}': not supported by the sglang backend"):
            caps.check("sglang", parse_sampling(sampling, response_length=8))
    with pytest.raises(UnsupportedError, match="cartridge"):
        caps.check("sglang", parse_sampling({}, response_length=8), cartridges=True)


def _eval(config: Path, data: Path, out: Path) -> list[dict]:
    from final import cli

    assert cli.main(["eval", "gsm8k", "--config", str(config), "--data", str(data), "--limit", "3", "--tools",
                     str(ROOT / "tools.yaml"), "--max-assistant-turns", "2", "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_eval_runs_on_the_tokasaurus_backend_with_the_same_answers(tmp_path, capsys):
    import yaml

    rollout = {"prompt_length": 512, "response_length": 16}
    # the server answers any turn of the client's conversations: its prompts may be the client's whole context
    served = start_served(prompt_length=1024, response_length=16)
    try:
        local = {**tiny_config(**rollout), "progress": False}
        toka = json.loads(json.dumps(local))
        toka["rollout"].update(name="tokasaurus", custom={"tokasaurus_url": served.url})
        for name, cfg in (("local", local), ("toka", toka)):
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        lines = (ROOT.parent / "shared/data/gsm8k/test.jsonl").read_text().splitlines()[:3] \
            if (ROOT.parent / "shared/data/gsm8k/test.jsonl").exists() else [json.dumps(
                {"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
                 "answer": f"{i} + {i + 1}\n#### {2 * i + 1}"}) for i in range(3)]
        data = tmp_path / "gsm8k.jsonl"
        data.write_text("\n".join(lines) + "\n")
        a = _eval(tmp_path / "local.yaml", data, tmp_path / "a.jsonl")
        assert "backend: local" in capsys.readouterr().out
        b = _eval(tmp_path / "toka.yaml", data, tmp_path / "b.jsonl")
        assert "backend: tokasaurus" in capsys.readouterr().out
    finally:
        stop_served(served)
    keys = ("index", "response", "final_text", "num_turns", "score", "tool_calls")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]


def test_generate_from_a_folder_without_config(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FINAL_CONFIG"}
    run = subprocess.run([sys.executable, "-m", "final.cli", "generate", "--model", "builtin:tiny-random-llama",
                          "--max-tokens", "3", "--temperature", "0", "hi"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "final/configs/default.yaml" in run.stderr and run.stdout.strip()
    (tmp_path / "mine.yaml").write_text(f"model_path: builtin:tiny-random-llama\nrollout: {{name: local, "
                                        f"prompt_length: 64, response_length: 4}}\n")
    run = subprocess.run([sys.executable, "-m", "final.cli", "generate", "hi"], cwd=tmp_path,
                         env={**env, "FINAL_CONFIG": "mine.yaml"}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "config mine.yaml" in run.stderr, run.stderr


def test_a_batch_call_is_one_message_to_the_engine_thread(tiny_inference):
    """The local batch path crosses threads twice: one Submit carries every row in, and one future (resolved on the
    engine thread after the DataProto is assembled there) brings the result out."""
    from final.engine.messages import Submit

    engine = tiny_inference.engine
    sent = []
    put = engine.core.inbox.put
    engine.core.inbox.put = lambda msg: (sent.append(type(msg)), put(msg))[1]
    try:
        out = tiny_inference.generate(["a", "b", "c", "d"], n=2, max_tokens=3, temperature=0)
    finally:
        engine.core.inbox.put = put
    assert sent == [Submit] and len(out.completions) == 8


def test_gather_or_cancel_stops_the_others_when_one_fails():
    """The one gather rule of the rollouts (tokasaurus' requests, multi-turn rows): a failure cancels the siblings
    before it propagates, so no orphaned request keeps the engine busy."""
    import asyncio

    from final.rollout.thread import gather_or_cancel

    from conftest import sleeps_until_cancelled

    cancelled = []

    def slow():
        return sleeps_until_cancelled(cancelled)

    async def bad():
        await asyncio.sleep(0)
        raise ValueError("row 1")

    async def main():
        with pytest.raises(ValueError, match="row 1"):
            await gather_or_cancel([slow(), bad(), slow()])
        assert await gather_or_cancel([asyncio.sleep(0, result=i) for i in range(3)]) == [0, 1, 2]

    asyncio.run(main())
    assert cancelled == [True, True]
