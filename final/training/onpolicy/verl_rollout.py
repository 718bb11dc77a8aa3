"""`--rollout verl`: the student's samples from veRL's own agent loop, as seed 000's on-policy loop draws them.

    VerlRollout.sample(conversations, n, seed)
      -> veRL's AgentLoopManager.generate_sequences (standalone, a local Ray on CPU; final.compat builds it as the
         lane's trainer does) -> its AgentLoopWorker actors -> our agent loop (below) -> veRL's server client
      -> the `tokasaurus` replica (final/verl_replica.py, registered in veRL's RolloutReplicaRegistry by veRL's
         plug-in hook VERL_USE_EXTERNAL_MODULES=final.verl_replica, or 0.9's `verl.plugins` entry point)
      -> POST /custom/cartridge/completions on `final serve` (started here, or the server at `server`) with
         `cartridges: [{id: <cartridge file>, source: local, force_redownload: true}]`, so each step's rewritten
         file is reloaded (the server reads it again only when it changed).

The replica's `cartridge_replaces_system_turn` (its default, true) drops the chat template's default system turn
that veRL's agent loop renders, so the server sees exactly final.prompts.continuation_ids(tokenizer, messages)
after the cartridge, as in-process InferenceEngine(cartridge=...) and training do; Rollout.prompt_ids are those ids.

Seeds. veRL's own agent loops cannot give a row a seed of its own. AgentLoopWorker.generate_sequences builds one
sampling_params dict for the whole batch from the rollout config, with no seed in it (veRL 0.6.0
verl/experimental/agent_loop/agent_loop.py:443-448: temperature, top_p, repetition_penalty, logprobs; 0.9.1
agent_loop.py:590-596 adds top_k, and :646 copies it per row unchanged), and SingleTurnAgentLoop hands that dict
to the server as it is (0.6.0 single_turn_agent_loop.py:50-52; 0.9.1 single_turn_agent_loop.py:70-80); the only
per-row values that reach the server are a random request id (uuid4: 0.6.0 :41, 0.9.1 :69) and, on 0.9.1, a
priority. 0.9.1's `rollout.seed` (default 42) seeds a server, not a row: its vLLM server gives every request of
a replica replica_rank + seed (verl/workers/rollout/vllm_rollout/vllm_async_server.py:627); 0.6.0 has no such key,
and neither reaches a replica's generate(). What veRL does give an agent loop is every non-tensor column of its
row (0.6.0 agent_loop.py:471, 0.9.1 :645), and it picks the loop by the row's `agent_name` among those named in
`rollout.agent.agent_loop_config_path` (0.6.0 agent_loop.py:396-400 and :497, 0.9.1 :534-539 and :682). So
`sample` names SeededSingleTurnAgentLoop there: veRL's SingleTurnAgentLoop with the row's `seed` column added to
its sampling params. Row r of a call (prompt-major: conversation r // n) samples with seed + r, the rule of
InferenceEngine.generate(conversations, n=n, seed=seed) (final.sampling.row_seed), and `final serve`'s embedded
engine draws each row with its own generator, whatever else is in the batch: the same seed gives the same samples
(and logprobs within 1e-4) as in-process generation with the same cartridge file (tests/test_distill_verl.py). A
greedy row draws nothing, so its seed is dropped (final/server/prepare.py). A server whose engine refuses per-request
seeds (final serve on the sglang backend: SGLang 0.5.2 has none) answers such rows with an error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from final.compat import STANDALONE_OVERRIDES, chat_ids, standalone_agent_loop
from final.errors import BackendUnavailableError, CartridgeError, PromptError, SamplingError
from final.models import resolve_model_path
from final.process_group import free_port
from final.prompts import after_system_turn, default_system_ids, normalize_prompts, object_array
from final.sampling import check_params, row_seed

REPLICA_MODULE = "final.verl_replica"  # veRL imports it by name (its plug-in hook); never imported from here
AGENT = "final_seeded_single_turn"
SERVER_START_S = 600.0


@dataclass
class Rollout:
    row: int  # index of the conversation (in the list given to sample) this sample answers
    prompt_ids: list[int]  # the tokens the server put after the cartridge (what the student saw)
    response_ids: list[int]
    logprobs: list[float]  # the server's logprob of each response token


class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """veRL's single-turn agent loop, with the row's own `seed` (a non-tensor column) in its sampling params.
    Distillation has no reward: the row's score is 0.0, so veRL's reward function is not asked to score it."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        seed = int(kwargs.pop("seed"))
        output = await super().run({**sampling_params, "seed": seed}, **kwargs)
        output.reward_score = 0.0
        return output


class VerlRollout:
    """Samples from the model plus the cartridge file at `cartridge` through veRL's agent loop; the file may be
    rewritten between calls. `server`: the URL of a `final serve` (or Tokasaurus) that can read `cartridge`;
    None starts `final serve` here (127.0.0.1, a free port, --cartridge-dir the cartridge's folder). Joins the Ray
    of this process if one is initialised (its workers must import final), else starts a private local one,
    stopped by close(). veRL 0.6.0 names its agent loop workers `agent_loop_worker_{i}`, so on that lane one
    VerlRollout (one AgentLoopManager) per Ray namespace at a time: close one before building the next."""

    def __init__(self, *, model: str, cartridge: Path, server: str | None = None, max_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, dtype: str = "float32", num_workers: int = 1,
                 max_prompt_tokens: int = 1024):
        self.cartridge = Path(cartridge).resolve()
        if not self.cartridge.is_file():
            raise CartridgeError("no cartridge file here", file=str(self.cartridge))
        for name, value in (("max_tokens", max_tokens), ("num_workers", num_workers),
                            ("max_prompt_tokens", max_prompt_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SamplingError(f"must be an integer >= 1, got {value!r}", name)
        check_params({"temperature": temperature, "top_p": top_p})  # SGLang's value rules, as the server's
        self.model_dir = resolve_model_path(model)
        self.max_prompt_tokens = max_prompt_tokens
        self._folder = Path(tempfile.mkdtemp(prefix="final-verl-rollout-"))
        self._server: subprocess.Popen | None = None
        self._own_ray = False
        self._manager: Any = None
        self._replicas: list[Any] = []
        try:
            self.url = server.rstrip("/") if server else self._spawn_server(model, dtype, max_tokens)
            self._start_ray(num_workers)  # while the server loads its model
            config = self._trainer_config(max_tokens, temperature, top_p, num_workers)
            self._manager, self._replicas = standalone_agent_loop(config)
            if self._server is not None:
                self._wait_for_server()
            from verl.utils import hf_tokenizer

            self.tokenizer = hf_tokenizer(self.model_dir)  # veRL's, as its AgentLoopWorker loads it
            self.system_turn = default_system_ids(self.tokenizer)  # what the replica drops (see module doc)
        except BaseException:
            self.close()
            raise

    # ---- sampling ---------------------------------------------------------------------------------------------
    def sample(self, conversations: list[list[dict]], n: int, seed: int, *, greedy: bool = False) -> list[Rollout]:
        """Every conversation n times (prompt-major), row r seeded seed + r, with the cartridge file as it is now.
        greedy: temperature 0 for this call (veRL's validation sampling, rollout.val_kwargs)."""
        if self._manager is None:
            raise BackendUnavailableError("this VerlRollout is closed")
        check_params({"n": n, "seed": seed})
        chats = self._check_conversations(conversations)
        rows = [i for i in range(len(chats)) for _ in range(n)]
        out = self._manager.generate_sequences(self._batch([chats[i] for i in rows], seed, bool(greedy)))
        return [Rollout(row, after_system_turn(p, self.system_turn), r, lps)
                for row, (p, r, lps) in zip(rows, _rows_of(out))]

    def _check_conversations(self, conversations: Any) -> list[list[dict]]:
        if not isinstance(conversations, list) or not conversations:
            raise PromptError("conversations must be a non-empty list of conversations (lists of messages)")
        for i, chat in enumerate(conversations):
            if not isinstance(chat, list) or not chat or not all(isinstance(m, dict) for m in chat):
                raise PromptError("must be a conversation (a list of {role, content} messages)", i)
        prompts = normalize_prompts(conversations)  # checks each message (role, content)
        for i, p in enumerate(prompts):
            size = len(chat_ids(self.tokenizer, p.messages, add_generation_prompt=True))
            if size > self.max_prompt_tokens:
                raise PromptError(f"renders to {size} tokens, over max_prompt_tokens={self.max_prompt_tokens}", i)
        return [p.messages for p in prompts]

    @staticmethod
    def _batch(chats: list[list[dict]], seed: int, greedy: bool) -> Any:
        from verl import DataProto

        return DataProto.from_dict(non_tensors={
            "raw_prompt": object_array(chats), "agent_name": object_array([AGENT] * len(chats)),
            "seed": object_array([row_seed(seed, r) for r in range(len(chats))])}, meta_info={"validate": greedy})

    # ---- the pieces: final serve, Ray, veRL's config ----------------------------------------------------------
    def _spawn_server(self, model: str, dtype: str, max_tokens: int) -> str:
        """`final serve` of `model` over the model's whole context window (cartridge + prompt + answer); its URL."""
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        positions = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
        if max_tokens >= positions:
            raise SamplingError(f"must be below the model's {positions} positions, got {max_tokens}", "max_tokens")
        config = self._folder / "serve.json"  # YAML is a superset of JSON
        config.write_text(json.dumps({"model_path": model, "progress": False, "rollout": {
            "name": "local", "dtype": dtype, "prompt_length": positions - max_tokens, "response_length": max_tokens}}))
        port = free_port()
        log = open(self._folder / "serve.log", "w")
        with log:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "final.cli", "serve", "--config", str(config), "--cartridge-dir",
                 str(self.cartridge.parent), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=log)
        return f"http://127.0.0.1:{port}"

    def _wait_for_server(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self._server.poll() is not None:
                tail = (self._folder / "serve.log").read_text()[-2000:]
                raise BackendUnavailableError(f"final serve exited with {self._server.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/ping", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise BackendUnavailableError(f"final serve did not answer /ping within {SERVER_START_S:.0f} s")

    def _start_ray(self, num_workers: int) -> None:
        """Join this process's Ray, or start a private local one whose workers import the replica (veRL's hook)
        and this process's `final`. The driver builds the replica, so veRL's hook runs here too."""
        import ray
        from verl.utils.import_utils import import_external_libs

        modules = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
        modules += [REPLICA_MODULE] if REPLICA_MODULE not in modules else []
        import_external_libs(modules)  # what verl/__init__.py does when the variable is set before `import verl`
        if ray.is_initialized():
            return
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds this `final` package
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {"VERL_USE_EXTERNAL_MODULES": ",".join(modules), "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
        # Ray places each AgentLoopWorker on a CPU, and 0.6.0's reward worker beside it holds one while alive
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2 * num_workers), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": env})
        self._own_ray = True

    def _trainer_config(self, max_tokens: int, temperature: float, top_p: float, num_workers: int) -> Any:
        """veRL's own ppo_trainer.yaml, composed by hydra, for a standalone agent loop over one tokasaurus replica."""
        import verl
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        loops = self._folder / "agent_loops.yaml"
        loops.write_text(json.dumps([{"name": AGENT, "_target_": f"{__name__}.{SeededSingleTurnAgentLoop.__name__}"}]))
        rollout = "actor_rollout_ref.rollout"
        with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"),
                                   version_base=None):
            config = compose("ppo_trainer", overrides=[
                f"actor_rollout_ref.model.path={self.model_dir}", f"{rollout}.name=tokasaurus", f"{rollout}.mode=async",
                f"{rollout}.tensor_model_parallel_size=1", f"{rollout}.prompt_length={self.max_prompt_tokens}",
                f"{rollout}.response_length={max_tokens}", f"{rollout}.temperature={float(temperature)}",
                f"{rollout}.top_p={float(top_p)}", f"{rollout}.calculate_log_probs=true",
                f"{rollout}.val_kwargs.temperature=0", f"{rollout}.val_kwargs.top_p=1.0",  # sample(greedy=True)
                f"{rollout}.free_cache_engine=false", f"{rollout}.agent.num_workers={num_workers}",
                f"{rollout}.agent.agent_loop_config_path={loops}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
                *STANDALONE_OVERRIDES])
        # seed 000's block (set here, not as an override: a path need not survive hydra's grammar)
        OmegaConf.update(config, f"{rollout}.engine_kwargs.tokasaurus", {
            "tokasaurus_url": self.url, "cartridge_replaces_system_turn": True,
            "cartridges": [{"id": str(self.cartridge), "source": "local", "force_redownload": True}]},
            force_add=True)
        return config

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop veRL's actors (and the Ray and `final serve` started here); safe to call twice."""
        import ray

        if self._manager is not None and ray.is_initialized():
            for actor in [*self._manager.agent_loop_workers, *(s for r in self._replicas for s in r.servers)]:
                ray.kill(actor)
        self._manager, self._replicas = None, []
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False
        if self._server is not None:
            self._server.terminate()  # SIGTERM: final serve drains and exits
            try:
                self._server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            self._server = None
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> "VerlRollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rows_of(out: Any) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids, rollout logprobs) of each row of veRL's DataProto, padding removed."""
    p = out.batch["prompts"].shape[1]
    mask = out.batch["attention_mask"].bool()
    rows = []
    for i in range(len(out)):
        keep = mask[i, p:]
        rows.append((out.batch["prompts"][i][mask[i, :p]].tolist(), out.batch["responses"][i][keep].tolist(),
                     out.batch["rollout_log_probs"][i][keep].tolist()))
    return rows
