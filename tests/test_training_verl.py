"""`--rollout verl` (final/distill/verl_rollout.py): the student's samples from veRL's own AgentLoopManager through
the `tokasaurus` replica and `final serve`, on CPU, on both lanes (veRL 0.6.0 and 0.9.1).

What runs for real: the tiny model in-process (the reference, and the cartridges' builder), one `final serve`
process and one private local Ray (both started by the module's VerlRollout: veRL 0.6.0 allows one
AgentLoopManager per Ray namespace at a time), veRL's agent loop workers and our replica actor. What reaches the
server is recorded by test_verl_replica's Relay, a transparent HTTP relay, in front of the same server.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from conftest import TINY
from final.errors import CartridgeError, ConfigError, PromptError, SamplingError
from final.prompts import continuation_ids, default_system_ids
from test_verl_replica import GREEDY, Relay, replica_and_client, trainer_config

R = 12  # max_tokens
CHATS = [[{"role": "user", "content": "Who keeps the lighthouse?"}],
         [{"role": "user", "content": "When does the ferry to Dunmore stop?"}]]


@pytest.fixture(scope="module")
def local():
    from final.inf import local_engine

    with local_engine(TINY, dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def carts(local, tmp_path_factory) -> dict[str, Path]:
    """Cartridges of two documents (doc_a.pt, doc_b.pt) and the file a trainer rewrites each step (training.pt)."""
    from serve_helpers import build_cartridge_files

    folder = tmp_path_factory.mktemp("carts")
    files = build_cartridge_files(local, folder)
    files["training"] = folder / "training.pt"
    shutil.copy(files["a"], files["training"])
    return files


@pytest.fixture(scope="module")
def rollout(carts):
    """Sampling at T=1 (greedy per call); starts `final serve` and the Ray of the module."""
    from final.training.onpolicy.verl_rollout import VerlRollout

    with VerlRollout(model=TINY, cartridge=carts["training"], max_tokens=R) as rollout:
        yield rollout


def reference(local, carts: dict, name: str, **sampling):
    """In-process generation with the same cartridge file."""
    cartridge = local.load_cartridge(path=str(carts[name]))
    return local.generate(CHATS, cartridge=cartridge, max_tokens=R, logprobs=True, **sampling)


def assert_same(rollouts, want) -> None:
    assert [r.response_ids for r in rollouts] == want.token_ids
    for r, meta in zip(rollouts, want.metadata):
        assert r.logprobs == pytest.approx(meta["logprobs"], abs=1e-4)


def test_greedy_samples_follow_the_rewritten_cartridge_and_equal_in_process(rollout, local, carts):
    seen = {}
    for name in ("a", "b"):
        shutil.copy(carts[name], carts["training"])  # the trainer rewrote the cartridge at the same path
        rows = rollout.sample(CHATS, n=1, seed=0, greedy=True)
        assert [r.row for r in rows] == [0, 1]
        assert [r.prompt_ids for r in rows] == [continuation_ids(local.tokenizer, c) for c in CHATS]
        assert_same(rows, reference(local, carts, name, temperature=0))
        seen[name] = rows[0]
    assert seen["a"].response_ids != seen["b"].response_ids and seen["a"].logprobs != seen["b"].logprobs


def test_seeded_samples_equal_in_process(rollout, local, carts):
    """Row r is seeded seed + r (final's agent loop adds the row's seed), as InferenceEngine.generate seeds its rows."""
    for name in ("a", "b"):
        shutil.copy(carts[name], carts["training"])
        rows = rollout.sample(CHATS, n=2, seed=0)
        assert [r.row for r in rows] == [0, 0, 1, 1]  # prompt-major
        assert_same(rows, reference(local, carts, name, n=2, temperature=1.0, seed=0))
        assert rows[0].response_ids != rows[1].response_ids
    def ids(seed: int) -> list[list[int]]:
        return [r.response_ids for r in rollout.sample(CHATS, n=2, seed=seed)]

    assert ids(0) == [r.response_ids for r in rows] != ids(1)


def test_the_server_sees_the_conversation_right_after_the_cartridge(rollout, local, carts):
    """The replica drops the default system turn that veRL's agent loop renders (SmolLM2's: "You are a helpful AI
    assistant named SmolLM..."): the ids that reach the server are continuation_ids, as in-process and training."""
    from final.compat import chat_ids
    from final.models import resolve_model_path

    shutil.copy(carts["a"], carts["training"])
    relay = Relay(rollout.url, local.tokenizer)
    try:
        spec = f"{{id:'{carts['training']}',source:local,force_redownload:true}}"
        _, client = replica_and_client(resolve_model_path(TINY), [
            f"+actor_rollout_ref.rollout.engine_kwargs.tokasaurus.cartridges=[{spec}]",
            f"actor_rollout_ref.rollout.response_length={R}"], relay.url)  # the server's answers are up to R long
        rendered = chat_ids(local.tokenizer, CHATS[0], add_generation_prompt=True)  # what veRL's agent loop sends
        system = default_system_ids(local.tokenizer)
        assert system and rendered == system + continuation_ids(local.tokenizer, CHATS[0])
        out = asyncio.run(client.generate("row", prompt_ids=rendered, sampling_params=dict(GREEDY)))
        [(sent, _)] = relay.relayed
        assert sent == continuation_ids(local.tokenizer, CHATS[0])
        assert out.token_ids == reference(local, carts, "a", temperature=0).token_ids[0]
    finally:
        relay.close()


def test_bad_calls_are_typed_errors(rollout, carts, tmp_path):
    from final.training.onpolicy.verl_rollout import VerlRollout

    with pytest.raises(CartridgeError):  # checked before anything starts
        VerlRollout(model=TINY, cartridge=tmp_path / "missing.pt", max_tokens=R)
    with pytest.raises(SamplingError) as err:
        VerlRollout(model=TINY, cartridge=carts["training"], max_tokens=R, temperature=-1.0)
    assert err.value.field == "temperature"
    with pytest.raises(PromptError) as err:
        rollout.sample([CHATS[0], "not a conversation"], n=1, seed=0)
    assert err.value.index == 1
    for n, seed, field in ((0, 0, "n"), (1, 1.5, "seed")):
        with pytest.raises(SamplingError) as err:
            rollout.sample(CHATS, n=n, seed=seed)
        assert err.value.field == field


def test_cartridge_replaces_system_turn_defaults_to_true_and_names_its_key(local):
    """The replica's setting, checked in the driver before any actor starts (no Ray needed)."""
    from final.models import resolve_model_path
    from final.verl_replica import TokasaurusReplica

    key = "+actor_rollout_ref.rollout.engine_kwargs.tokasaurus"
    with_cartridge = f"{key}.cartridges=[{{id:'/tmp/c.pt',source:local,force_redownload:true}}]"

    def replica(*overrides: str):
        cfg = trainer_config(resolve_model_path(TINY), "http://127.0.0.1:9", *overrides)
        return TokasaurusReplica(replica_rank=0, config=cfg.actor_rollout_ref.rollout,
                                 model_config=cfg.actor_rollout_ref.model, gpus_per_node=1)

    assert replica(with_cartridge).system_turn == default_system_ids(local.tokenizer) != []
    assert replica(with_cartridge, f"{key}.cartridge_replaces_system_turn=false").system_turn == []
    assert replica().system_turn == []  # no cartridge: the prompt goes as rendered
    with pytest.raises(ConfigError) as err:
        replica(with_cartridge, f"{key}.cartridge_replaces_system_turn=maybe")
    assert err.value.key == "rollout.engine_kwargs.tokasaurus.cartridge_replaces_system_turn"
