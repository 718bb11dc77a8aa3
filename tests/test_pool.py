"""final.pool on a real local Ray cluster: two replicas of the tiny model (each an InferenceEngine in its own
Ray actor) give exactly what one InferenceEngine gives, rows in the caller's order, cartridges and tools included,
and a replica killed mid-call loses no row.

Ray starts once for this module (module-scoped fixtures); no other test file starts it. The replica-death test
runs last: it kills both replicas of the shared pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from cartridges_helpers import random_cart
from conftest import TINY, tiny_config
from final.cartridges.format import save_cartridge
from final.pool import ReplicaPool, open_engine
from final.pool.chunks import Chunk, plan_chunks
from final.errors import CartridgeError, ConfigError, ModelError, PromptError, ReplicaError, SamplingError
from final.inf import InferenceEngine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hi", "Name a color.", "Count to three.", "What is 2+2?", "Tell a joke.", "Why is the sky blue?",
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}], [1, 504, 3458, 2]]
CALL = '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>'

pytestmark = pytest.mark.timeout(300)  # a hang (a replica that never answers) fails instead of blocking CI


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # the machine's two cores, no dashboard; pools below join this cluster rather than start their own
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_cluster):
    with ReplicaPool(tiny_config(), replicas=2) as p:
        yield p


def test_eval_with_replicas_gives_the_same_answers(ray_cluster, tmp_path, capsys):
    """`final eval gsm8k --replicas 2` prints the same per-problem answers as one engine (greedy). First in the
    module: its pools need the cluster's two CPUs, which the module's shared pool holds from its first use on."""
    import yaml

    from final import cli

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config(prompt_length=256, response_length=12)))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {i} apples and gets {i + 2} more. How many?",
                                        "answer": f"#### {2 * i + 2}"}) + "\n" for i in range(8)))
    results = {}
    for replicas in (1, 2):
        out = tmp_path / f"r{replicas}.jsonl"
        assert cli.main(["eval", "gsm8k", "--config", str(tmp_path / "c.yaml"), "--data", str(data), "--limit", "8",
                         "--replicas", str(replicas), "--out", str(out)]) == 0
        results[replicas] = [(r["index"], r["final_text"], r["score"]) for r in map(json.loads, out.open())]
    assert results[1] == results[2] and len(results[1]) == 8
    assert "accuracy" in capsys.readouterr().out


def rows(out) -> list[tuple]:
    """A GenerationOutput's rows without the pool's own metadata key (which replica ran the row) and the weights
    version (the shared pool's count of updates, test_weight_updates_reach_every_replica_under_one_version's)."""
    return [(c, t, {k: v for k, v in m.items() if k not in ("replica", "weights_version")})
            for c, t, m in zip(out.completions, out.token_ids, out.metadata)]


def with_chunk_rows(pool, size: int, **kwargs):
    """generate() with small chunks, so both replicas take several of them."""
    pool.chunk_rows = size
    try:
        return pool.generate(**kwargs)
    finally:
        pool.chunk_rows = None


def test_plan_chunks_cover_every_row_once_in_order():
    for prompts, n, replicas, size in ((8, 1, 2, None), (3, 5, 2, 2), (5, 2, 2, 3), (1, 8, 4, None), (7, 3, 3, 1)):
        chunks = plan_chunks(prompts, n, replicas, max_rows=256, chunk_rows=size)
        assert sorted(p * n + s for c in chunks for p, s in c.rows()) == list(range(prompts * n))
        assert [p * n + s for c in chunks for p, s in c.rows()] == list(range(prompts * n))  # prompt-major
    assert plan_chunks(3, 5, 2, 256, chunk_rows=2) [:3] == [Chunk(0, 1, 0, 2), Chunk(0, 1, 2, 2), Chunk(0, 1, 4, 1)]
    assert len(plan_chunks(64, 1, 2, max_rows=4)) == 16  # never more rows per chunk than the engine's batch


def test_greedy_and_seeded_rows_equal_one_engine(pool, tiny_inference):
    assert [i["threads"] for i in pool.info] == [1, 1]  # each replica has its share of the two cores
    greedy = dict(prompts=PROMPTS, temperature=0, max_tokens=12)
    assert rows(pool.generate(**greedy)) == rows(tiny_inference.generate(**greedy))
    # n=3 with chunks of 2 rows: a prompt's samples are split across chunks (and replicas); each row still
    # samples with seed + its global row, so the tokens are the single engine's
    seeded = dict(prompts=PROMPTS, temperature=1.0, seed=11, n=3, max_tokens=12)
    out = with_chunk_rows(pool, 2, **seeded)
    ref = tiny_inference.generate(**seeded)
    assert rows(out) == rows(ref)
    assert [(m["prompt_index"], m["sample_index"]) for m in out.metadata] == [(i // 3, i % 3) for i in range(24)]
    assert out.grouped() == ref.grouped() and out.n == 3
    assert {m["replica"] for m in out.metadata} == {0, 1}  # the work really was shared
    assert len(set(map(tuple, out.token_ids))) > 12  # and it really sampled (rows differ)


def test_scores_equal_one_engine(pool, tiny_inference):
    prompts, continuations = PROMPTS[:5], [" yes", " red", None, " 4", [42, 7]]
    for a, b in zip(pool.score(prompts, continuations, top_logprobs=2),
                    tiny_inference.score(prompts, continuations, top_logprobs=2)):
        assert (a.prompt_ids, a.continuation_ids, a.is_greedy) == (b.prompt_ids, b.continuation_ids, b.is_greedy)
        assert a.prompt_logprobs[1:] + a.continuation_logprobs == \
            pytest.approx(b.prompt_logprobs[1:] + b.continuation_logprobs, abs=1e-5)  # batched differently


def test_constrained_rows_validate_on_every_replica(pool, tiny_inference):
    """The constraint keys travel with the rows: every replica compiles the grammar and masks its own rows."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"], "x-guidance": {
        "whitespace_flexible": False}, "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer",
                                                                                        "minimum": 0, "maximum": 99}}}
    call = dict(prompts=PROMPTS[:4], json_schema=schema, n=2, seed=5, max_tokens=16)
    out = with_chunk_rows(pool, 2, **call)
    assert {m["replica"] for m in out.metadata} == {0, 1}
    for text in out.completions:
        jsonschema.validate(json.loads(text), schema)
    assert rows(out) == rows(tiny_inference.generate(**call))
    with pytest.raises(SamplingError) as info:
        pool.generate(prompts=["Hi"], regex="(unclosed", max_tokens=4)
    assert info.value.field == "regex"


def test_agenerate_and_generate_inside_a_running_loop(pool, tiny_inference):
    async def main():
        a = await pool.agenerate(PROMPTS[:3], temperature=0, max_tokens=8)
        b = pool.generate(PROMPTS[:3], temperature=0, max_tokens=8)  # blocking call from a loop (a notebook cell)
        return a, b

    a, b = asyncio.run(main())
    assert rows(a) == rows(b) == rows(tiny_inference.generate(PROMPTS[:3], temperature=0, max_tokens=8))


def test_cartridges_are_loaded_on_every_replica(pool, tiny_inference, tmp_path):
    path = save_cartridge(random_cart(tokens=8, seed=3), tmp_path / "doc.pt")
    cid = pool.load_cartridge(path=str(path))
    try:
        assert tiny_inference.load_cartridge(path=str(path)) == cid
        assert pool.call(lambda engine: engine.cartridges.ids()) == [[cid], [cid]]
        q = ["Who keeps the lighthouse?", "Name a cat.", "Why?", "Hi"]
        # one entry per prompt: with, without, composed twice, without -- in chunks of one prompt each
        kwargs = dict(prompts=q, cartridge=[cid, None, [cid, cid], None], temperature=0, max_tokens=8)
        assert rows(with_chunk_rows(pool, 1, **kwargs)) == rows(tiny_inference.generate(**kwargs))
        every = dict(prompts=q, cartridge=cid, temperature=0, max_tokens=8)  # one id for every prompt
        assert rows(with_chunk_rows(pool, 1, **every)) == rows(tiny_inference.generate(**every))
        assert pool.unload_cartridge(cid) is True
        with pytest.raises(CartridgeError, match="unknown cartridge"):
            pool.generate("Hi", cartridge=cid)
        with pytest.raises(CartridgeError):  # a bad file is refused by every replica, and none keeps it
            pool.load_cartridge(path=str(tmp_path / "missing.pt"))
        assert pool.call(lambda engine: engine.cartridges.ids()) == [[], []]
    finally:
        tiny_inference.unload_cartridge(cid)


def test_bad_input_raises_typed_errors_and_the_pool_keeps_serving(pool, ray_cluster):
    with pytest.raises(PromptError) as err:
        pool.generate(["fine", "also fine", ""])
    assert err.value.index == 2  # the caller's index, not a chunk's
    with pytest.raises(SamplingError) as err:
        pool.generate("Hi", temperature=-1)
    assert err.value.field == "temperature"
    with pytest.raises(CartridgeError, match="unknown cartridge"):
        pool.generate("Hi", cartridge="nope")
    with pytest.raises(ConfigError, match="tools_kwargs"):
        pool.generate("Hi", tools_kwargs={"x": {}})
    assert pool.generate("Hi", max_tokens=2).completions  # still serving
    # refused before any replica starts: the config, the count, what the cluster cannot hold
    with pytest.raises(ConfigError) as err:
        ReplicaPool({**tiny_config(), "replicaz": 2})
    assert err.value.key == "replicaz"
    for bad in (0, "2", True):
        with pytest.raises(ConfigError) as err:
            ReplicaPool(tiny_config(), replicas=bad)
        assert err.value.key == "replicas"
    with pytest.raises(ConfigError, match="need 3 CPU; the Ray cluster has 2"):
        ReplicaPool(tiny_config(), replicas=3, num_cpus=1)
    # a replica's own start-up error comes back as InferenceEngine raises it (num_cpus=0: the pool holds both CPUs)
    with pytest.raises(ModelError):
        ReplicaPool({**tiny_config(), "model_path": "/nonexistent/model"}, replicas=1, num_cpus=0)


def test_the_pool_applies_the_queue_bound_and_the_deadline(pool):
    """limits.max_queued_rows and limits.deadline_s hold at the pool's door as on one engine; the pool serves on."""
    import dataclasses

    from final.admission import Admission
    from final.errors import DeadlineError, OverloadedError

    config, admission = pool.config, pool._admission
    try:
        pool._admission = Admission(4)  # as if limits.max_queued_rows were 4

        async def two_calls():
            first = asyncio.ensure_future(pool.agenerate(PROMPTS[:4], max_tokens=8, ignore_eos=True))
            await asyncio.sleep(0)  # the first call is admitted (its rows counted) before the second asks
            with pytest.raises(OverloadedError, match="max_queued_rows=4") as err:
                await pool.agenerate("Hi", max_tokens=2)
            assert err.value.retry_after > 0
            return await first

        assert len(asyncio.run(two_calls()).completions) == 4
        pool._admission = admission
        pool.config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, deadline_s=0.001))
        with pytest.raises(DeadlineError):
            pool.generate(PROMPTS, max_tokens=16, ignore_eos=True)
    finally:
        pool.config, pool._admission = config, admission
    assert pool.generate("Hi", max_tokens=2).completions  # still serving


def test_open_engine_with_one_replica_never_starts_ray(monkeypatch):
    import ray

    # veRL imports ray (verl/protocol.py), so `ray` is always in sys.modules: what must not happen is ray.init
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init called for one local replica"))
    with open_engine({**tiny_config(), "replicas": 2}, replicas=1) as engine:  # the argument beats the config
        assert type(engine) is InferenceEngine
        assert engine.generate("Hi", max_tokens=2).completions
    with pytest.raises(ConfigError) as err:
        open_engine({**tiny_config(), "replicas": -1})
    assert err.value.key == "replicas"
    with pytest.raises(ConfigError) as err:
        open_engine(tiny_config(), ray_address="")
    assert err.value.key == "ray_address"


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory) -> str:
    from final.models import resolve_model_path
    from multiturn_helpers import make_tool_model

    return make_tool_model(resolve_model_path(TINY), tmp_path_factory.mktemp("tm") / "m")


def _script_the_model(engine) -> None:
    """In each replica: the model answers from a script (call the tool, then answer) so tools really run."""
    from multiturn_helpers import ScriptedEngine

    engine.rollout.multi_turn.engine = ScriptedEngine(engine.tokenizer, {"ALPHA": ["Checking.\n" + CALL, "#### 72"],
                                                                         "BETA": ["#### 3"]})


def test_multi_turn_tools_run_inside_each_replica(ray_cluster, pool, tool_dir):
    config = {"model_path": tool_dir, "progress": False,
              "rollout": {"name": "local", "prompt_length": 512, "response_length": 64,
                          "multi_turn": {"enable": True, "tool_config_path": str(ROOT / "tools.yaml"),
                                         "tokenization_sanity_check_mode": "disable"}}}
    prompts = ["ALPHA one", "BETA two", "ALPHA three", "BETA four"]
    kwargs = [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": g}}} for g in ("72", "3", "70", "3")]
    # the shared pool holds both CPUs: these replicas take none (they run one after the other's test anyway)
    with ReplicaPool(config, replicas=2, num_cpus=0, chunk_rows=1) as tools_pool, InferenceEngine(config) as one:
        # the real tiny model, seeded: the multi-turn path's seed rule holds across replicas
        seeded = dict(prompts=prompts, tools_kwargs=kwargs, temperature=1.0, seed=5, n=2, max_tokens=12)
        assert rows(tools_pool.generate(**seeded)) == rows(one.generate(**seeded))
        tools_pool.call(_script_the_model)
        _script_the_model(one)
        out = tools_pool.generate(prompts, tools_kwargs=kwargs)
        assert rows(out) == rows(one.generate(prompts, tools_kwargs=kwargs))
    assert {m["replica"] for m in out.metadata} == {0, 1}
    assert out.completions == ["#### 72", "#### 3", "#### 72", "#### 3"]
    # ALPHA rows called the tool in their replica (right answer for "72", wrong for "70"); BETA rows never did
    assert [m["rewards"]["calc_gsm8k_reward"] for m in out.metadata] == [1.0, 0, 0.0, 0]
    assert [m["role"] for m in out.metadata[0]["messages"]] == ["user", "assistant", "tool", "assistant"]


def test_cli_generate_with_replicas_starts_and_stops_its_own_ray(tmp_path, tiny_inference):
    """`final generate` with `replicas: 2` in the config: a private Ray, the single engine's answers, and no Ray
    process left afterwards (each process the run started carries a marker in its environment)."""
    import psutil
    import yaml

    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**tiny_config(), "replicas": 2}))
    mark = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FINAL_TEST_MARK": mark}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "final.cli", "generate", "--config", str(cfg), "--temperature", "0",
                           "--max-tokens", "8", "--json", *PROMPTS[:4]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["completions"] == tiny_inference.generate(PROMPTS[:4], temperature=0, max_tokens=8).completions
    assert {m["replica"] for m in got["metadata"]} <= {0, 1}

    def left_over() -> list[str]:
        found = []
        for p in psutil.process_iter(["name"]):
            try:
                if p.environ().get("FINAL_TEST_MARK") == mark:
                    found.append(f"{p.pid} {p.info['name']}")
            except (psutil.Error, OSError):
                pass
        return found

    deadline = time.monotonic() + 60  # Ray's processes exit on their own after shutdown; give them a moment
    while left_over() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left_over() == []


def test_final_serve_on_a_pool(pool, tiny_inference):
    """The server takes a pool as it takes an InferenceEngine: same checks, same answers."""
    import httpx

    from final.server.app import ServerThread, create_app

    with ServerThread(create_app(pool)) as server:
        body = {"model": "m", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
                "temperature": 0, "n": 2}
        got = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        want = tiny_inference.generate([[{"role": "user", "content": "Name a color."}]], max_tokens=6,
                                       temperature=0, n=2)
        assert [c["message"]["content"] for c in got["choices"]] == want.completions
        assert got["usage"]["prompt_tokens"] == want.metadata[0]["prompt_tokens"]
        stream = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4,
                                                                   "temperature": 0, "stream": True}, timeout=120)
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        bad = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "Hi", "temperature": -1},
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        usage = httpx.get(f"{server.url}/custom/cartridges", timeout=60).json()
        assert len(usage["replicas"]) == len(pool.alive)  # each replica's own store and references
        assert all(r["metrics"] is not None for r in usage["replicas"])


def _hang_when_generating(engine, started: str) -> None:
    """Replica 0: say so (a file) when its first chunk arrives, then never answer it."""
    def run(*args, **kwargs):
        Path(started).touch()
        while True:
            time.sleep(1)

    engine.run = run  # a replica runs each chunk with InferenceEngine.run


def _crash_when_generating(engine) -> None:
    def run(*args, **kwargs):
        os._exit(1)  # the process dies as on an OOM kill: no exception, no goodbye

    engine.run = run


def test_weight_updates_reach_every_replica_under_one_version(pool, tiny_dir):
    """update_weights returns once every replica serves the new weights: greedy rows are HF generate's on the
    updated model whichever replica runs them, each row says the version; a partial update too; a bad update is
    refused by every replica and nothing changes. The original weights go back at the end (later tests)."""
    from final.errors import WeightsError
    from weights_helpers import hf_greedy, perturbed, state_of

    prompts = [f"prompt {i}" for i in range(8)]
    ids = pool.prepare(prompts).ids

    def rows():
        out = pool.generate(prompts, temperature=0, max_tokens=8)
        return out.token_ids, {m["weights_version"] for m in out.metadata}, {m["replica"] for m in out.metadata}

    original = perturbed(tiny_dir, scale=0.0)
    before, versions, _ = rows()
    trained = perturbed(tiny_dir, scale=0.5, seed=21)
    assert pool.update_weights(trained) == pool.weights_version == 1
    after, versions, replicas = rows()
    assert versions == {1} and len(replicas) == 2 and after == hf_greedy(trained, ids, 8)
    one_layer = perturbed(tiny_dir, scale=2.0, seed=22, only="layers.0.mlp")
    pool.update_weights(state_of(one_layer, "layers.0.mlp"))
    merged = perturbed(tiny_dir, scale=0.0)
    merged.load_state_dict({**trained.state_dict(), **state_of(one_layer, "layers.0.mlp")})
    partial, versions, _ = rows()
    assert versions == {2} and partial == hf_greedy(merged, ids, 8)
    with pytest.raises(WeightsError, match="model.layers.1.mlp.down_proj.weight"):
        pool.update_weights({**trained.state_dict(), "model.layers.1.mlp.down_proj.weight": torch.zeros(2)})
    assert rows()[:2] == (partial, {2}) and pool.weights_version == 2
    pool.release()
    assert rows()[0] == partial  # each replica resumes by itself
    pool.update_weights(original)
    assert rows()[0] == before


def test_a_killed_replica_has_its_rows_retried_and_none_left_is_a_typed_error(pool, tiny_inference, tmp_path):
    """Runs last: the shared pool ends with both replicas dead."""
    import ray

    started = tmp_path / "started"
    pool.call(functools.partial(_hang_when_generating, started=str(started)), replica=0)
    seeded = dict(prompts=PROMPTS, temperature=1.0, seed=3, n=2, max_tokens=10)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        call = ex.submit(with_chunk_rows, pool, 2, **seeded)
        deadline = time.monotonic() + 120  # a guard against a broken test, not a measurement
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), "replica 0 never received a chunk"
        ray.kill(pool.actors[0])  # mid-call: replica 0 holds a chunk it will never return
        out = call.result(timeout=240)
    assert rows(out) == rows(tiny_inference.generate(**seeded))  # every row exactly once, with its own seed
    assert {m["replica"] for m in out.metadata} == {1}
    assert pool.alive == [1] and "ray.kill" in pool.dead[0]
    with pytest.raises(ReplicaError, match="replica 0 is not serving"):
        pool.call(_crash_when_generating, replica=0)

    pool.call(_crash_when_generating, replica=1)
    with pytest.raises(ReplicaError) as err:
        pool.generate(PROMPTS, max_tokens=4)
    assert set(err.value.replicas) == {0, 1}
    assert "ray.kill" in err.value.replicas[0] and "replica 1" in str(err.value)
    with pytest.raises(ReplicaError, match="no replica is left"):
        pool.generate("Hi")
