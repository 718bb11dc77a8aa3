"""The verl09 lane's SGLang backend (final/rollout/sglang/rollout_0512.py) on the real SGLang 0.5.12 engine, veRL
0.9.1's pin, on CPU: its tokenizer manager, scheduler and detokenizer processes, radix cache, KV pool and Llama
code. Only the compiled kernels (tests/sglang_cpu) and torchvision and pinned memory (tests/sglang_cpu/verl09) are
stood in for. Differential: the DataProto must be LocalRollout's, key for key (the verl06 lane's differential tests,
collected here). One engine serves the rollout tests and one, with tools, the InferenceEngine tests (a start costs
~25 s here).

These cases run in a process of their own (tests/test_sglang_direct.py starts it), with the stand-ins on the path
from the start: transformers decides at import whether torchvision exists, and builds its lazy `AutoImageProcessor`
on that, which SGLang 0.5.12 registers into at import.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import subprocess
import sys

import pytest
import torch

from final import compat
from sglang_helpers import (CPU_ARGS, PROMPTS, STUBS, STUBS_09, TINY, assert_same_output, both, dataproto,
                            rollout_pair, use_sglang_cpu)

pytestmark = pytest.mark.skipif(compat.LANE != "verl09", reason="the verl09 lane's backend (SGLang 0.5.12); the "
                                "verl06 lane's is tests/test_sglang_rollout.py")


# The differential tests of the verl06 lane's backend hold for this one as written: collected here, they run on
# this module's `pair` (greedy batches key for key, truncation and padding, eos, val_kwargs, stop strings, calls from
# threads and a running loop, rows repeated and sampled).
from test_sglang_rollout import (  # noqa: E402,F401
    test_eos_stops_and_masks_the_rest, test_generate_from_threads_and_event_loops,
    test_greedy_batch_matches_local_key_for_key, test_response_length_truncation_and_padding,
    test_sampling_with_n_repeats, test_stop_strings_end_generation_as_on_the_embedded_engine,
    test_validation_uses_val_kwargs)


@pytest.fixture(scope="module")
def pair():
    yield from rollout_pair()


def test_it_is_the_real_sglang_0_5_12_engine(pair):
    import sgl_kernel
    import sglang
    import torchvision
    from sglang.srt.entrypoints.engine import Engine

    from final.rollout.sglang.rollout_0512 import DirectSGLangRollout

    rollout = pair[0]
    assert isinstance(rollout, DirectSGLangRollout)
    assert importlib.metadata.version("sglang") == sglang.__version__ == "0.5.12" and "site-packages" in sglang.__file__
    assert sgl_kernel.__file__.startswith(STUBS) and torchvision.__file__.startswith(STUBS_09)  # only these stood in
    engine = rollout.engine.engine
    assert isinstance(engine, Engine)
    args = engine.server_args
    assert (args.tp_size, args.device, args.skip_tokenizer_init, args.grammar_backend) == (1, "cpu", False, "final")
    assert args.port + 10000 <= 65535  # SGLang 0.5.12's gRPC port is port + 10000
    assert rollout.engine.processes and all(p.is_running() for p in rollout.engine.processes)


def test_bad_requests_raise_typed_errors_and_serving_goes_on(pair):
    from final.errors import PromptError, SamplingError, UnsupportedError

    sglang, _, model_cfg = pair
    with pytest.raises(UnsupportedError, match="enable_deterministic_inference") as err:
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), seed=3)  # SGLang would ignore it silently
    assert err.value.field == "seed"
    with pytest.raises(SamplingError, match="'temprature'"):
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), temprature=0.5)
    with pytest.raises(SamplingError, match="top_p"):
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), top_p=0.0)
    vocab = model_cfg.hf_config.vocab_size
    with pytest.raises(PromptError, match=r"prompt 1: .*outside the vocabulary"):
        sglang.engine.submit_generate([[1, 17], [1, vocab + 5]], {"max_new_tokens": 2}).result()
    with pytest.raises(PromptError, match=r"cartridge\(s\) \['doc'\] are not loaded"):
        sglang.engine.submit_generate([[1, 17]], {"max_new_tokens": 2}, cartridges=[("doc",)]).result()
    a, b = both(pair, PROMPTS, {"do_sample": False})
    assert_same_output(a, b)


def test_a_cancelled_call_aborts_its_rows_and_others_go_on(pair):
    """Calls from one running loop overlap on the engine's loop; a caller cancelled mid-call aborts its rows (SGLang
    is told by rid) and the engine goes on serving."""
    sglang, _, model_cfg = pair
    expected = sglang.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False})).batch["responses"]

    async def in_a_loop():
        calls = [sglang.agenerate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False})) for _ in range(3)]
        # the batch path's own wait (agenerate_sequences awaits it), on rows too long to finish before the cancel on
        # any machine (the rollout's response_length caps agenerate_sequences at 12 tokens: 50 ms on a fast CPU)
        slow = asyncio.ensure_future(sglang.engine.submit_generate(
            [[1, 17, 99]] * 2, {"max_new_tokens": 500, "ignore_eos": True}).wait())
        await asyncio.sleep(0.05)
        assert not slow.done()
        slow.cancel()
        outs = await asyncio.gather(*calls)
        with pytest.raises(asyncio.CancelledError):
            await slow
        return outs

    for out in asyncio.run(in_a_loop()):
        assert torch.equal(out.batch["responses"], expected)
    again = sglang.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False}))
    assert torch.equal(again.batch["responses"], expected)


def test_a_dead_scheduler_and_shutdown(pair):
    """A scheduler that dies while serving ends the waiting call with EngineError (SGLang leaves it waiting) and
    refuses later ones; SGLang 0.5.12's Engine.shutdown kills every child of the process, final's only the
    engine's."""
    import signal

    from final.errors import EngineError

    sglang, _, model_cfg = pair
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        procs = list(sglang.engine.processes)
        scheduler = next(p for p in procs if "scheduler" in " ".join(p.cmdline()))
        slow = sglang.engine.submit_generate([[1, 17, 99]] * 4, {"max_new_tokens": 2000, "ignore_eos": True})
        scheduler.send_signal(signal.SIGKILL)
        with pytest.raises(EngineError, match=f"process {scheduler.pid} exited while serving"):
            slow.result()
        with pytest.raises(EngineError, match="exited while serving"):
            sglang.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False}))
        sglang.shutdown()
        assert not any(p.is_running() and p.status() != "zombie" for p in procs)
        assert bystander.poll() is None  # still running
        sglang.shutdown()  # idempotent
        with pytest.raises(EngineError, match="shut down"):
            sglang.engine.submit_generate([[1, 17]], {"max_new_tokens": 2})
    finally:
        bystander.kill()
        bystander.wait()


# ---- InferenceEngine on it: tools, scoring, refusals ---------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    use_sglang_cpu()
    from final.inf import InferenceEngine
    from final.models import resolve_model_path
    from multiturn_helpers import make_tool_model
    from test_sglang_inference import ROOT

    model = make_tool_model(resolve_model_path(TINY), tmp_path_factory.mktemp("tm") / "m")
    tools = {"enable": True, "tool_config_path": str(ROOT / "tools.yaml"), "tokenization_sanity_check_mode": "disable"}
    config = {"model_path": model, "progress": False, "rollout": {
        "name": "sglang", "dtype": "float32", "prompt_length": 256, "response_length": 12,
        "multi_turn": tools, "engine_kwargs": {"sglang": dict(CPU_ARGS)}}}
    with InferenceEngine(config) as eng, InferenceEngine({**config, "rollout": {
            **config["rollout"], "name": "local", "engine_kwargs": {}}}) as local:
        yield eng, local


def test_generate_with_tools_of_tools_yaml(engine):
    eng, local = engine
    assert eng.backend == "sglang" and eng.tool_names() == ["calc_gsm8k_reward"]
    events, ref_events = [], []
    out = eng.generate("What is 2+2?", temperature=0, max_tokens=8, on_event=events.append)
    ref = local.generate("What is 2+2?", temperature=0, max_tokens=8, on_event=ref_events.append)
    assert out.token_ids == ref.token_ids and out.completions == ref.completions
    meta = out.metadata[0]
    assert meta["messages"][0] == {"role": "user", "content": "What is 2+2?"} and meta["num_turns"] >= 1
    assert [e["type"] for e in events] == [e["type"] for e in ref_events] and events


def test_scores_equal_the_embedded_engine(engine):
    from test_sglang_scoring import CONTINUATIONS, PROMPTS as TEXTS, same_scores

    eng, local = engine
    for a, b in zip(eng.score(TEXTS, CONTINUATIONS, top_logprobs=3, raw=True),
                    local.score(TEXTS, CONTINUATIONS, top_logprobs=3, raw=True)):
        same_scores(a, b)


def test_what_it_cannot_serve_is_refused_before_any_work(engine):
    from final.errors import CartridgeError, UnsupportedError

    eng, _ = engine
    with pytest.raises(UnsupportedError, match="enable_deterministic_inference") as err:
        eng.generate("hi", seed=1)
    assert err.value.backend == "sglang" and err.value.field == "seed"
    with pytest.raises(CartridgeError, match="unknown cartridge"):  # served (sglang_direct_cartridge_cases.py)
        eng.generate("hi", cartridge="doc")
    rows = []

    async def stream():
        async for row in eng.astream(eng.prepare("hi", temperature=0, max_tokens=3)):
            rows.append(row)

    asyncio.run(stream())
    # multi-turn on: each row arrives whole, as on every backend (token streams: sglang_direct_cartridge_cases.py)
    assert len(rows) == 1 and rows[0].finish_reason in ("stop", "length")
    assert eng.generate("hi", temperature=0, max_tokens=2).completions  # still serving


def test_constraints_are_served_as_on_the_embedded_engine(engine):
    """final's grammar backend in SGLang's scheduler: the same masks, so greedy rows equal the embedded engine's,
    and every output is valid; a bad constraint is the same typed error."""
    import json

    from final.errors import SamplingError

    eng, local = engine
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"], "x-guidance": {
        "whitespace_flexible": False}, "properties": {"ok": {"type": "boolean"}}}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "A: "}, {"type": "regex", "pattern": "[0-9]{2}"}]}}
    for key, value in (("json_schema", schema), ("regex", "(yes|no)[0-9]"), ("ebnf", 'root ::= "x" [a-c]+ "."'),
                       ("structural_tag", tag)):
        call = dict(prompts=["Hi", "JSON please"], temperature=0, max_tokens=12, **{key: value})
        out, ref = eng.generate(**call), local.generate(**call)
        assert out.token_ids == ref.token_ids and out.completions == ref.completions, key
    assert all(json.loads(t) in ({"ok": True}, {"ok": False}) for t in eng.generate(
        ["Hi", "Ho"], json_schema=schema, temperature=0, max_tokens=12).completions)
    for bad in ({"regex": "(a"}, {"json_schema": "{"}):
        fields = []
        for backend in (eng, local):
            with pytest.raises(SamplingError) as err:
                backend.generate("hi", max_tokens=4, **bad)
            fields.append(err.value.field)
        assert fields == [next(iter(bad))] * 2
    assert eng.generate("hi", temperature=0, max_tokens=2).completions  # still serving


def test_engine_kwargs_are_checked_against_sglang_0_5_12_before_it_starts():
    use_sglang_cpu()  # before transformers is imported (see rollout_pair)
    from final.errors import ConfigError
    from final.rollout.sglang.rollout_0512 import DirectSGLangRollout
    from sglang_helpers import configs

    sg_cfg, _, model_cfg = configs(sglang_args={"max_total_tokns": 64})
    with pytest.raises(ConfigError, match="not an SGLang 0.5.12 ServerArgs field; did you mean 'max_total_tokens'") \
            as err:
        DirectSGLangRollout(sg_cfg, model_cfg)
    assert err.value.key == "rollout.engine_kwargs.sglang.max_total_tokns"
