"""veRL's own server mode generating through the `tokasaurus` replica (final/verl_replica.py), on CPU, on both
lanes (veRL 0.6.0 and 0.9.1).

What runs for real: a `final serve` process on 127.0.0.1 (the tiny model, embedded engine), a private local Ray
(started once for the module), the trainer config composed by hydra from veRL's own ppo_trainer.yaml, and veRL's
AgentLoopManager in standalone mode -> its AgentLoopWorker actors -> AsyncLLMServerManager (0.6.0) or the
LLMServerManager's LLMServerClient (0.9.1) -> our TokasaurusHttpServer actor -> HTTP. The cartridge and dying-server
tests drive a replica through that client exactly as AgentLoopWorker does.

Between Ray and the server sits `Relay`, a transparent HTTP relay that records what passes; for the tool-calling
row it answers the model's *first* turn itself with a tool call (the tiny random model never writes one), and
relays the rest to the real server.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import TINY, tiny_config
from final.compat import LANE, chat_ids
from final.errors import BackendUnavailableError, ConfigError
from final.protocol.fingerprint import make_fingerprint
from serve_helpers import spawn_serve, stop_serve


ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "final.verl_replica"
R = 96  # response_length: room for a tool call, its response and an answer
CALL = '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>'


# ---- the pieces: a final serve process, a relay, Ray, the trainer config ----------------------------------------
def start_server(model: str, cartridge_dir: Path) -> tuple[str, subprocess.Popen]:
    return spawn_serve("--model", model, "--cartridge-dir", str(cartridge_dir), cwd=ROOT)


class Relay:
    """A real HTTP server on 127.0.0.1 that relays POSTs to `upstream` and records (prompt ids, answer ids).
    `script(prompt_text)` may answer a request itself (a Tokasaurus completion); `kill` (a process) is SIGKILLed
    when the `kill_at`-th POST arrives. A relay that cannot reach upstream drops the connection unanswered."""

    def __init__(self, upstream: str, tokenizer, script=None, kill: subprocess.Popen | None = None, kill_at: int = 0):
        self.upstream, self.tokenizer, self.script = upstream, tokenizer, script
        self.kill, self.kill_at = kill, kill_at
        self.posts, self.relayed, self.lock = 0, [], threading.Lock()
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = relay.answer(self.path, body)
                if answer is None:
                    self.close_connection = True
                    return self.connection.close()
                self._send(answer)

            def _send(self, content: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, path: str, body: dict) -> bytes | None:
        with self.lock:
            self.posts += 1
            if self.kill is not None and self.posts >= self.kill_at and self.kill.poll() is None:
                self.kill.send_signal(signal.SIGKILL)
                self.kill.wait()
        scripted = self.script(self.tokenizer.decode(body["prompt"])) if self.script else None
        if scripted is not None:
            ids = self.tokenizer.encode(scripted, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            return json.dumps({"id": "scripted", "object": "text_completion", "model": "m", "created": 0,
                               "choices": [{"index": 0, "text": scripted, "finish_reason": "stop"}],
                               "system_fingerprint": make_fingerprint([ids], [[0.0] * len(ids)])}).encode()
        try:
            resp = httpx.post(self.upstream + path, json=body, timeout=60)
        except httpx.TransportError:
            return None
        with self.lock:
            self.relayed.append((body["prompt"], json.loads(json.loads(resp.content)["system_fingerprint"])))
        return resp.content

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def first_turn_calls_the_tool(prompt: str) -> str | None:
    return CALL if "ALPHA" in prompt and "<tool_response>" not in prompt else None  # the system turn names <tool_call>


def tools_yaml() -> Path:
    """The shipped tools.yaml for veRL's own tool loader. veRL 0.9 removed verl.tools.gsm8k_tool, which it names;
    final's InferenceEngine maps the name (final.compat.TOOL_MODULES), but veRL's AgentLoopWorker loads the class
    itself, so a 0.9 trainer's tools.yaml names final's port of it: final.tools.gsm8k.Gsm8kTool."""
    if LANE == "verl06":
        return ROOT / "tools.yaml"
    text = (ROOT / "tools.yaml").read_text().replace("verl.tools.gsm8k_tool.Gsm8kTool", "final.tools.gsm8k.Gsm8kTool")
    path = Path(tempfile.gettempdir()) / f"final-verl09-tools-{os.getpid()}.yaml"
    path.write_text(text)
    return path


def trainer_config(model: str, url: str, *overrides: str):
    """veRL's own ppo_trainer.yaml with the overrides a CPU run needs and the replica's settings (veRL 0.6.0:
    rollout.engine_kwargs.tokasaurus, see final/verl_replica.py)."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.rollout.name=tokasaurus", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.prompt_length=256", f"actor_rollout_ref.rollout.response_length={R}",
            "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.free_cache_engine=false",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml()}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
            # 0.9.1's standalone replicas count the rollout's own nodes (0 by default: hybrid)
            *(["actor_rollout_ref.rollout.nnodes=1"] if LANE == "verl09" else []),
            f"+actor_rollout_ref.rollout.engine_kwargs.tokasaurus.tokasaurus_url={url}", *overrides])


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    import final.verl_replica  # noqa: F401  (the driver registers `tokasaurus`; workers import it by the env var)

    # this checkout's `final` in every Ray worker, and the plug-in hook as a user sets it
    env = {"VERL_USE_EXTERNAL_MODULES": PLUGIN, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep), "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": env})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def cart_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("carts")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny model with Qwen2.5's chat template (veRL's ToolAgentLoop renders `[{}]` through the template, which
    SmolLM2's refuses) and <tool_call> as one token: same weights, same vocabulary (tests/multiturn_helpers.py)."""
    from multiturn_helpers import make_tool_model

    from final.models import resolve_model_path

    return make_tool_model(resolve_model_path(TINY), tmp_path_factory.mktemp("model") / "m")


@pytest.fixture(scope="module")
def server(model, cart_dir):
    url, proc = start_server(model, cart_dir)
    yield url
    stop_serve(proc)


def engine_config(model: str, **rollout) -> dict:
    cfg = tiny_config(prompt_length=256, response_length=R, **rollout)
    return {**cfg, "model_path": model}


@pytest.fixture(scope="module")
def local(model):
    from final.inf import InferenceEngine

    with InferenceEngine(engine_config(model)) as engine:
        yield engine


@pytest.fixture(scope="module")
def relay(server, local):
    r = Relay(server, local.tokenizer, script=first_turn_calls_the_tool)
    yield r
    r.close()


@pytest.fixture(scope="module")
def manager(ray_cluster, model, relay):
    """veRL's AgentLoopManager in standalone mode, built as each lane's trainer builds it: 0.6.0 starts the
    replicas itself; 0.9.1 takes an `llm_client` from an LLMServerManager that started them."""
    from verl.experimental.agent_loop import AgentLoopManager

    config = trainer_config(model, relay.url)
    if LANE == "verl06":
        return AgentLoopManager(config)
    from verl.workers.rollout.llm_server import LLMServerManager

    return AgentLoopManager.create(config, LLMServerManager.create(config).get_client())


def batch(messages: list, **extra):
    from verl import DataProto

    n = len(messages)
    rows = {"raw_prompt": messages, "data_source": ["openai/gsm8k"] * n,  # RewardManagerWorker scores every row
            "reward_model": [{"ground_truth": "72", "style": "rule"}] * n, **extra}
    return DataProto.from_dict(non_tensors={k: np.array(v + [None], dtype=object)[:-1] for k, v in rows.items()})


def rows_of(out) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids, rollout logprobs) per row, padding removed."""
    p = out.batch["prompts"].shape[1]
    mask = out.batch["attention_mask"]
    res = []
    for i in range(len(out)):
        prompt = out.batch["prompts"][i][mask[i, :p].bool()].tolist()
        keep = mask[i, p:].bool()
        res.append((prompt, out.batch["responses"][i][keep].tolist(), out.batch["rollout_log_probs"][i][keep].tolist()))
    return res


def replica_and_client(model: str, rollout_overrides: list[str], url: str):
    """A TokasaurusReplica in standalone mode and the client an AgentLoopWorker generates through: 0.6.0's
    AsyncLLMServerManager over the replica's handle; 0.9.1's LLMServerClient from the LLMServerManager that
    started the replica (through veRL's registry, as its trainer does)."""
    cfg = trainer_config(model, url, *rollout_overrides)
    if LANE == "verl09":
        from verl.workers.rollout.llm_server import LLMServerManager

        servers = LLMServerManager.create(cfg)
        [replica] = servers.get_replicas()
        return replica, servers.get_client()
    from verl.experimental.agent_loop.agent_loop import AsyncLLMServerManager

    from final.verl_replica import TokasaurusReplica

    replica = TokasaurusReplica(replica_rank=0, config=cfg.actor_rollout_ref.rollout,
                                model_config=cfg.actor_rollout_ref.model, gpus_per_node=1)
    asyncio.run(replica.init_standalone())
    return replica, AsyncLLMServerManager(cfg, [replica.server_handle])


GREEDY = {"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "logprobs": True}


# ---- the tests ----------------------------------------------------------------------------------------------------
def test_agent_loop_manager_equals_inference_engine_local_and_tokasaurus(manager, model, server, local):
    from final.inf import InferenceEngine

    chats = [[{"role": "user", "content": c}] for c in ("Hello there", "What is two plus two?", "Name a colour.")]
    out = manager.generate_sequences(batch(chats))
    assert out.batch["responses"].shape == (3, R) and set(out.batch.keys()) >= {
        "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs"}
    rows = rows_of(out)
    prompts = [p for p, _, _ in rows]
    assert prompts == [chat_ids(local.tokenizer, c, add_generation_prompt=True) for c in chats]
    ref = local.generate(prompts, temperature=0, max_tokens=R, logprobs=True)
    with InferenceEngine(engine_config(model, name="tokasaurus", custom={"tokasaurus_url": server})) as toka:
        over_http = toka.generate(prompts, temperature=0, max_tokens=R)
    assert [r for _, r, _ in rows] == ref.token_ids == over_http.token_ids
    for (_, _, lps), meta in zip(rows, ref.metadata):
        assert lps == pytest.approx(meta["logprobs"], abs=1e-4)


def test_tool_agent_loop_runs_a_multi_turn_row(manager, relay, local):
    chats = [[{"role": "user", "content": "ALPHA: what is 8 * 9?"}]]
    before = len(relay.relayed)
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    out = manager.generate_sequences(batch(chats, agent_name=["tool_agent"], tools_kwargs=[kwargs]))
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4]  # user, assistant (tool call), tool, assistant
    mask = out.batch["response_mask"][0].tolist()
    response = out.batch["responses"][0].tolist()
    called = local.tokenizer.encode(CALL, add_special_tokens=False) + [local.tokenizer.eos_token_id]
    first = len(called)
    tool_end = first + mask[first:].index(1)
    assert mask[:first] == [1] * first and response[:first] == called  # turn 1: the scripted tool call
    assert "reward=1.0" in local.tokenizer.decode(response[first:tool_end])  # the tool ran (Gsm8kTool, 72 right)
    # turn 2 came from the real server, on the conversation so far (prompt + call + tool response)
    (sent, answer), = relay.relayed[before:]
    assert sent == rows_of(out)[0][0] + response[:tool_end]
    assert response[tool_end:tool_end + len(answer["completion_ids"][0])] == answer["completion_ids"][0][:R - tool_end]


def test_a_cartridge_rewritten_between_steps_is_seen_and_an_unchanged_one_is_not_reread(ray_cluster, model, server,
                                                                                        local, cart_dir):
    from serve_helpers import build_cartridge_files

    from final.cartridges.build import continuation_ids

    files = build_cartridge_files(local, cart_dir)
    training = cart_dir / "training.pt"
    shutil.copy(files["a"], training)
    spec = f"{{id:'{training}',source:local,force_redownload:true}}"
    replica, client = replica_and_client(
        model, [f"+actor_rollout_ref.rollout.engine_kwargs.tokasaurus.cartridges=[{spec}]"], server)
    q = continuation_ids(local.tokenizer, "Who keeps the lighthouse?")
    want = {k: local.generate([q], cartridge=local.load_cartridge(path=str(f)), temperature=0, max_tokens=R)
            for k, f in files.items()}

    def step() -> tuple[list[int], int]:
        out = asyncio.run(client.generate("row", prompt_ids=q, sampling_params=dict(GREEDY)))
        return out.token_ids, httpx.get(f"{server}/custom/cartridges").json()["metrics"]["loads"]

    ids, loads = step()
    assert ids == want["a"].token_ids[0] and ids != want["b"].token_ids[0]
    assert step() == (ids, loads)  # unchanged file: not read again
    shutil.copy(files["b"], training)  # the trainer wrote the next step's cartridge to the same path
    ids, reloaded = step()
    assert ids == want["b"].token_ids[0] and reloaded == loads + 1
    # what veRL calls around a step (0.6.0: wake_up/sleep; 0.9: also the weight-sync brackets) changes nothing
    import ray

    asyncio.run(replica.wake_up())
    asyncio.run(replica.sleep())
    h = replica.server_handle
    ray.get([h.abort_all_requests.remote(), h.resume_generation.remote(), h.release_kv_cache.remote(),
             h.resume_kv_cache.remote(), h.clear_kv_cache.remote()])
    assert step() == (ids, reloaded)


def test_a_server_dying_mid_batch_gives_the_retries_then_a_typed_error(ray_cluster, model, local, tmp_path):
    url, proc = start_server(model, tmp_path)
    relay = Relay(url, local.tokenizer, kill=proc, kill_at=3)  # two rows answered, then the server is gone
    try:
        key = "+actor_rollout_ref.rollout.engine_kwargs.tokasaurus"
        settings = [f"{key}.max_retries=2", f"{key}.retry_delay=0.05", f"{key}.base_timeout=20"]
        _, client = replica_and_client(model, settings, relay.url)
        q = local.tokenizer.encode("Once upon a time")

        async def one(i: int):
            return await client.generate(f"row{i}", prompt_ids=q, sampling_params=dict(GREEDY))

        done = [asyncio.run(one(i)) for i in range(2)]
        assert all(len(o.token_ids) > 0 for o in done)

        async def rest():
            return await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(2, 6)]), timeout=120)

        with pytest.raises(BackendUnavailableError, match=r"after 3 attempt\(s\)"):
            asyncio.run(rest())
        assert relay.posts >= 2 + 3  # the failing row was tried 1 + max_retries times
    finally:
        relay.close()
        proc.kill()


def test_settings_are_validated_naming_the_key(model):
    from final.verl_replica import TokasaurusReplica

    server = "http://127.0.0.1:9"  # never contacted: the replica checks its settings before any actor starts

    def replica(cfg):
        return TokasaurusReplica(replica_rank=0, config=cfg.actor_rollout_ref.rollout,
                                 model_config=cfg.actor_rollout_ref.model, gpus_per_node=1)

    key = "+actor_rollout_ref.rollout.engine_kwargs.tokasaurus"
    with pytest.raises(ConfigError) as err:
        replica(trainer_config(model, server, f"{key}.max_retries=-1"))
    assert err.value.key == "rollout.engine_kwargs.tokasaurus.max_retries"
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.tokasaurus\.cartridges\[0\]"):
        replica(trainer_config(model, server, f"{key}.cartridges=[{{id:x,kind:y}}]"))


def test_the_plug_in_hook_registers_the_replica_and_the_hybrid_worker_rollout():
    """What a user's trainer gets from VERL_USE_EXTERNAL_MODULES alone (a fresh interpreter, no import line)."""
    code = ("import asyncio, verl\n"
            "from verl.workers.rollout.replica import get_rollout_replica_class\n"
            "from verl.workers.rollout import get_rollout_class\n"
            "print(get_rollout_replica_class('tokasaurus').__name__)\n"
            "cls = get_rollout_class('tokasaurus', 'async')\n"
            "w = cls(config=None, model_config=None, device_mesh=None)\n"
            "asyncio.run(w.resume(tags=['weights']))\n"
            "asyncio.run(w.update_weights(iter(())))\n"
            "asyncio.run(w.release())\n"
            "print(cls.__name__)\n")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": PLUGIN, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["TokasaurusReplica", "TokasaurusWorkerRollout"]
