"""Cartridges on the SGLang backend, end to end through InferenceEngine: reserved ids, KV written into the real
SGLang 0.5.2 scheduler's radix cache and KV pool (on CPU) over collective_rpc, locked, re-injected after every flush
and memory resume. The embedded engine's own cartridge prefix is the reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import tiny_config
from sglang_helpers import CPU_ARGS, dataproto, use_sglang_cpu

DOC = "The lighthouse keeper of Orvanis is called Mara Quill. She keeps three cats named Pip, Jot and Fennel."
DOC2 = "Orvanis has one bakery, run by Tomas Reed, who bakes rye bread on Tuesdays."
QUESTION = "Who keeps the lighthouse?"


def sglang_config() -> dict:
    cfg = tiny_config(prompt_length=256, dtype="float32")
    cfg["rollout"].update(name="sglang", engine_kwargs={"sglang": {**CPU_ARGS, "context_length": 1024}})
    return cfg


def cartridge_engines(tmp_path_factory):
    """The embedded engine and SGLang (this lane's), each with the same two built cartridges loaded ("doc",
    "bakery"): yields (sglang, local, files). tests/sglang_direct_cartridge_cases.py uses it on SGLang 0.5.12."""
    use_sglang_cpu()
    from final.cartridges.build import build_from_text, document_ids
    from final.rollout.sglang.procs import survive_sigquit

    survive_sigquit()  # InferenceEngine builds rollouts off the main thread, where this cannot be done
    from final.cartridges.format import save_cartridge
    from final.inf import InferenceEngine

    local = InferenceEngine(tiny_config(prompt_length=256, dtype="float32"))
    files = {}
    for name, text in (("doc", DOC), ("bakery", DOC2)):
        files[name] = tmp_path_factory.mktemp("carts") / f"{name}.pt"
        save_cartridge(build_from_text(local.engine, document_ids(local.tokenizer, text)), files[name])
    sglang = InferenceEngine(sglang_config())
    for eng in (local, sglang):
        for name, path in files.items():
            eng.load_cartridge(id=name, path=str(path))
    yield sglang, local, files
    sglang.shutdown()
    local.shutdown()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    yield from cartridge_engines(tmp_path_factory)


def ask(eng, prompts=QUESTION, **kw):
    return eng.generate(prompts, temperature=0, max_tokens=12, **kw).token_ids


def test_injected_cartridge_answers_like_the_embedded_prefix(engines):
    sglang, local, _ = engines
    assert sglang.backend == "sglang" and sglang.rollout.cartridge_ids() == ["bakery", "doc"]
    with_cart = ask(sglang, cartridge="doc")
    assert with_cart == ask(local, cartridge="doc")
    # the cartridge stands for the document: the same answer as prefilling it
    assert with_cart == ask(sglang, [{"role": "system", "content": DOC}, {"role": "user", "content": QUESTION}])
    assert with_cart != ask(sglang)
    rows = [QUESTION, QUESTION, QUESTION]
    carts = ["doc", None, ["doc", "bakery"]]  # per row: one, none, a composition in order
    assert ask(sglang, rows, cartridge=carts) == ask(local, rows, cartridge=carts)


def test_flush_and_memory_release_reinject(engines):
    sglang, local, _ = engines
    expected = ask(local, cartridge="bakery")
    assert ask(sglang, cartridge="bakery") == expected  # veRL flushed the radix cache after the last call
    rollout = sglang.rollout
    engine = rollout.sglang_engine
    def cycle():
        loop = asyncio.get_event_loop()
        loop.run_until_complete(engine.release_memory_occupation(tags=["kv_cache"]))
        loop.run_until_complete(engine.resume_memory_occupation(tags=["kv_cache"]))  # the pool comes back zeroed

    rollout._call(cycle)
    assert ask(sglang, cartridge="bakery") == expected


def test_cartridge_kv_lives_in_pool_slots_and_host_memory_only(engines):
    """The scheduler's resident copy of each cartridge is host memory (on CUDA, a device copy sat outside SGLang's
    mem_fraction_static budget, besides the pool slots, and outlived release_memory_occupation); the pool slots
    are the only device copy; releasing the KV memory leaves no slot held, resuming injects them again."""
    sglang, local, _ = engines
    rollout = sglang.rollout
    engine = rollout.sglang_engine
    lengths = {c: len(rollout._call(lambda c=c: engine.cartridges.prefix((c,)))) for c in rollout.cartridge_ids()}
    dims = engine.cartridges.dims
    per_token = 2 * dims.layers * dims.kv_heads * dims.head_dim * 4  # K and V, every layer, float32
    mem = rollout.cartridge_memory()
    assert mem["device_bytes"] == 0 and mem["host_bytes"] == per_token * sum(lengths.values())
    assert mem["pool_tokens"] >= sum(lengths.values()) and not mem["kv_released"]

    def memory_call(name):
        asyncio.get_event_loop().run_until_complete(getattr(engine, name)(tags=["kv_cache"]))

    rollout._call(lambda: memory_call("release_memory_occupation"))
    released = rollout.cartridge_memory()
    assert released["kv_released"] and released["pool_tokens"] == 0 and released["pool_free"] > mem["pool_free"]
    rollout._call(lambda: memory_call("resume_memory_occupation"))
    assert rollout.cartridge_memory()["pool_tokens"] == mem["pool_tokens"]
    assert ask(sglang, cartridge="doc") == ask(local, cartridge="doc")


def test_unload_reload_and_reserved_ids(engines):
    from final.errors import CartridgeError, PromptError

    sglang, local, files = engines
    rollout = sglang.rollout
    reserved = rollout._call(lambda: rollout.sglang_engine.cartridges.prefix(("doc",)))[0]
    with pytest.raises(PromptError, match="reserved for cartridges"):
        sglang.generate([reserved, 17, 99], max_tokens=2)  # a plain prompt may not start with a cartridge's id
    assert sglang.unload_cartridge("doc") is True
    with pytest.raises(CartridgeError, match="unknown cartridge"):
        sglang.generate(QUESTION, cartridge="doc")
    with pytest.raises(PromptError, match="not loaded"):
        rollout._call(lambda: rollout.sglang_engine.cartridges.prefix(("doc",)))
    with pytest.raises(PromptError, match="reserved for cartridges"):  # retired until the next flush
        sglang.generate([reserved, 17, 99], max_tokens=2)
    sglang.generate(QUESTION, max_tokens=2)  # ... which this call's flush is
    assert sglang.generate([reserved, 17, 99], max_tokens=2).completions
    sglang.load_cartridge(id="doc", path=str(files["doc"]))
    assert ask(sglang, cartridge="doc") == ask(local, cartridge="doc")


def test_a_cartridge_missing_from_the_cache_is_an_error_not_garbage(engines):
    from final.errors import EngineError

    sglang, local, files = engines
    rollout = sglang.rollout
    engine = rollout.sglang_engine

    def forget_in_scheduler_then_flush():  # what a lost re-injection would look like
        engine.collective_rpc("final_cartridge_unload", cartridge_id="bakery")
        asyncio.get_event_loop().run_until_complete(engine.flush_cache())

    rollout._call(forget_in_scheduler_then_flush)
    with pytest.raises(EngineError, match="not served from SGLang's radix cache"):
        ask(sglang, cartridge="bakery")
    sglang.load_cartridge(id="bakery", path=str(files["bakery"]), force_redownload=True)  # replaced: injected again
    assert ask(sglang, cartridge="bakery") == ask(local, cartridge="bakery")


def test_bad_cartridges_and_requests_raise_typed_errors(engines):
    from final.errors import CartridgeError, PromptError

    sglang, _, _ = engines
    rollout = sglang.rollout
    k = [torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16)]
    with pytest.raises(CartridgeError, match="one tensor per layer"):
        rollout.load_cartridge("bad", k[:1], k[:1])
    with pytest.raises(CartridgeError, match="the model needs"):
        rollout.load_cartridge("bad", [torch.zeros(1, 3, 5, 16)] * 2, [torch.zeros(1, 3, 5, 16)] * 2)
    with pytest.raises(CartridgeError, match="tokens"):
        rollout.load_cartridge("bad", k, [torch.zeros(1, 2, 4, 16)] * 2)
    with pytest.raises(CartridgeError, match="non-empty string"):
        rollout.load_cartridge("", k, k)
    room = [torch.randn(2, 3000, 16)] * 2  # the KV pool holds 2048 tokens (CPU_ARGS)
    with pytest.raises(CartridgeError, match="no room for 3000 cartridge tokens"):
        rollout.load_cartridge("huge", room, room)
    big = [torch.randn(2, 1010, 16) * 0.1, torch.randn(2, 1010, 16) * 0.1]  # context_length is 1024
    assert rollout.load_cartridge("huge", big, big) == 1010
    data = dataproto(sglang.model_config, [[17, 99, 1000]], non_tensor={"cartridges": [("huge",)]})
    with pytest.raises(PromptError, match="do not fit the context"):
        rollout.generate_sequences(data)
    assert rollout.unload_cartridge("huge") and not rollout.unload_cartridge("huge")
    assert "huge" not in rollout.cartridge_ids()


def test_the_multi_turn_path_carries_cartridges_to_the_engine_call(engines):
    """veRL's multi-turn path re-tokenizes each row from raw_prompt (the chat template) and calls the engine per
    request: the row's cartridge rides along in the request's task context (every call checks it was served
    from the radix cache), including the final prompt-scoring call of calculate_log_probs (a [1, L] tensor,
    logprob_start_len=0)."""
    from final.cartridges.format import load_cartridge
    from final.prompts import Prompt, build_dataproto, tokenize
    from final.rollout.sglang.rollout_052 import SGLangRollout
    from sglang_helpers import configs

    sglang, _, files = engines
    sg_cfg, _, model_cfg = configs({"multi_turn": {"enable": True}, "prompt_length": 256, "response_length": 16})
    tok = model_cfg.tokenizer
    prompts = [Prompt(messages=[{"role": "user", "content": QUESTION}])] * 2
    ids = tokenize(prompts, tok, 256)  # what veRL's multi-turn path computes from raw_prompt

    def data():
        return build_dataproto(ids, prompts, tok.pad_token_id, [tok.eos_token_id], meta_info={"do_sample": False},
                               non_tensor={"cartridges": [("doc",), ()]})

    cart = load_cartridge(files["doc"])
    with SGLangRollout(sg_cfg, model_cfg) as multi_turn:
        multi_turn.load_cartridge("doc", cart.keys, cart.values)
        out = multi_turn.generate_sequences(data())
    assert "response_mask" in out.batch.keys() and "rollout_log_probs" in out.batch.keys()
    first = out.batch["responses"][:, 0]
    assert first[0] != first[1]  # the cartridge changed row 0's answer
    # ... as the batch path answers the same ids (veRL's own tokenization of raw_prompt) after the same cartridge
    width = out.batch["prompts"].shape[1]
    mt_ids = out.batch["prompts"][0][out.batch["attention_mask"][0, :width].bool()].tolist()
    batch = sglang.rollout.generate_sequences(
        dataproto(model_cfg, [mt_ids], {"do_sample": False}, non_tensor={"cartridges": [("doc",)]}))
    assert batch.batch["responses"][0, 0] == first[0]


@pytest.mark.parametrize("layout,positions", [("june", "after_prefix"), ("later", "from_zero")])
def test_cartridges_repo_files_give_hf_logprobs(engines, tmp_path, layout, positions):
    """Real SGLang serves both cartridges-repo conventions exactly: a from_zero cartridge's keys are rotated at
    load, nothing in the engine changes (issue 19; the same check runs on the embedded engine and final serve)."""
    from compat_helpers import JUNE_CONFIG, LATER_CONFIG, reference, write_run

    sglang, _, _ = engines
    ref = reference()
    config = {"june": JUNE_CONFIG, "later": LATER_CONFIG}[layout]
    last = write_run(tmp_path / layout, ref["keys"], ref["values"], layout=layout, config=config)
    cid = sglang.load_cartridge(id=f"repo-{layout}", path=str(last))
    score = sglang.score([ref["cont"]], cartridge=cid)[0]
    assert score.cached_tokens == ref["p"]
    assert score.prompt_logprobs[1:] == pytest.approx(ref[positions], abs=2e-4)
    assert sglang.unload_cartridge(cid)


def test_a_trained_cartridge_serves_on_sglang_like_the_embedded_engine(engines, tmp_path):
    """A cartridge from `final cartridge train` (fact rows through the local engine, distilled on HF's model) is
    injected into SGLang's radix cache and answers as the embedded engine serves it."""
    from final.training.document.facts import write_fact_rows
    from final.training.settings import FactConfig, TrainConfig
    from final.training.train import train_cartridge

    sglang, local, _ = engines
    data = tmp_path / "rows.jsonl"
    write_fact_rows(local, DOC, data, FactConfig(top_k=5))
    out = tmp_path / "trained.pt"
    train_cartridge(local.config.model_path, data, out, TrainConfig(tokens=8, steps=2, batch=2), text=DOC,
                    progress=False)
    for eng in (local, sglang):
        eng.load_cartridge(id="trained", path=str(out))
    try:
        assert ask(sglang, cartridge="trained") == ask(local, cartridge="trained")
        assert ask(sglang, cartridge="trained") != ask(sglang)
    finally:
        for eng in (local, sglang):
            eng.unload_cartridge("trained")


def test_a_refused_flush_is_retried_until_the_scheduler_is_idle():
    """SGLang's scheduler refuses a flush while a just-finished request is still in its running batch (seen under
    load: "#running-req: 1" right after the answer came back); flush_until_idle asks again a few times."""
    import asyncio
    from types import SimpleNamespace

    from final.rollout.sglang.cartridges import FLUSH_TRIES, flush_until_idle

    def scheduler(busy_for):
        calls = []

        async def flush():
            calls.append(1)
            return SimpleNamespace(success=len(calls) > busy_for)
        return flush, calls

    flush, calls = scheduler(2)
    assert asyncio.run(flush_until_idle(flush)).success and len(calls) == 3
    flush, calls = scheduler(99)  # requests really running: refused, as SGLang said, after FLUSH_TRIES asks
    assert not asyncio.run(flush_until_idle(flush)).success and len(calls) == FLUSH_TRIES


def test_a_failed_load_leaves_no_trace(engines, tmp_path):
    """Issue 43 finding 1: a load refused for room leaves nothing behind; its reserved id is reused, a flush
    follows (it used to re-inject the failed cartridge and kill the scheduler), everything else serves exactly."""
    from sglang_cartridge_checks import check_a_failed_load_leaves_no_trace

    check_a_failed_load_leaves_no_trace(engines, tmp_path, ask)


def test_a_prompt_of_reserved_ids_sent_before_a_load_changes_nothing(engines, tmp_path):
    """Issue 43 finding 2: a prompt [r] * 8 cached before a cartridge gets r cannot become that cartridge's KV."""
    from sglang_cartridge_checks import check_reserved_id_prompts_sent_first_change_nothing

    check_reserved_id_prompts_sent_first_change_nothing(engines, tmp_path)


def test_compositions_are_bounded_and_checked_before_injection(engines):
    """Issue 43 finding 3: a composition too long for the context locks nothing; at most max_compositions
    compositions stay injected (least recently used released)."""
    from sglang_cartridge_checks import check_compositions_bounded_and_checked_first

    check_compositions_bounded_and_checked_first(engines, ask)
