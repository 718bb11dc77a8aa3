"""The differential test of the SGLang path: veRL 0.6.0's real SGLangRollout on the real SGLang 0.5.2 engine (its
tokenizer manager, scheduler and detokenizer processes, radix cache, KV pool and Llama code, on CPU; only the
compiled kernels are stubbed, tests/sglang_cpu) must return the DataProto LocalRollout returns. One engine serves
the whole module (a start costs 7-15 s and ~1.2 GB)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from sglang_helpers import PROMPTS, STUBS, assert_same_output, both, dataproto, pythonpath, rollout_pair

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair():
    yield from rollout_pair()


def test_it_is_verls_own_class_on_the_real_sglang_engine(pair):
    import sgl_kernel
    import sglang
    import torch.distributed as dist
    from sglang.srt.entrypoints.engine import Engine
    from verl.workers.rollout.sglang_rollout.sglang_rollout import AsyncEngine, SGLangRollout as VerlSGLangRollout

    rollout = pair[0]
    assert importlib.metadata.version("sglang") == sglang.__version__ == "0.5.2"  # the installed package
    assert "site-packages" in sglang.__file__
    assert sgl_kernel.__file__.startswith(STUBS)  # ... and only its CUDA kernels stubbed
    assert isinstance(rollout._rollout, VerlSGLangRollout)
    assert isinstance(rollout.sglang_engine, AsyncEngine) and isinstance(rollout.sglang_engine, Engine)
    args = rollout.sglang_engine.server_args
    assert (args.tp_size, args.skip_tokenizer_init, args.load_format, args.device) == (1, True, "auto", "cpu")
    assert args.port != 30000  # our free port, not veRL's fixed one
    assert args.enable_memory_saver is False and args.base_gpu_id == 0  # veRL hard-codes True and 0
    assert rollout.sglang_engine.port_args.nccl_port == args.nccl_port
    assert dist.is_initialized() and dist.get_world_size() == 1


def test_importing_the_backend_keeps_the_threads_event_loops():
    """SGLang's engine module installs uvloop's policy at import, which made every thread forget its current loop
    (veRL's get_event_loop() then failed on the engine thread). Importing final's backend leaves them alone."""
    code = ("import asyncio, threading\n"
            "loop = asyncio.new_event_loop(); asyncio.set_event_loop(loop)\n"
            "policy = asyncio.get_event_loop_policy()\n"
            "import final.rollout.sglang.engine_052, sglang.srt.entrypoints.engine\n"
            "print(asyncio.get_event_loop_policy() is policy, asyncio.get_event_loop() is loop)\n")
    env = {**os.environ, "PYTHONPATH": pythonpath(str(REPO))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.stdout.split() == ["True", "True"], done.stderr[-3000:]


def test_greedy_batch_matches_local_key_for_key(pair):
    a, b = both(pair, PROMPTS, {"do_sample": False})
    assert_same_output(a, b)
    assert a.batch["responses"].shape == (4, 12) and "rollout_log_probs" in a.batch.keys()
    # prompts of different lengths are left-padded to the longest, responses right-padded to response_length
    assert a.batch["prompts"].shape == (4, 12) and a.meta_info == b.meta_info


def test_response_length_truncation_and_padding(pair):
    a, b = both(pair, PROMPTS[:2], {"do_sample": False}, max_new_tokens=5)
    assert_same_output(a, b)
    mask = a.batch["attention_mask"][:, -12:]
    # 5 tokens, then padding; veRL's get_response_mask keeps the first eos, and the pad token is eos here
    assert mask[:, :6].all() and not mask[:, 6:].any()


def test_eos_stops_and_masks_the_rest(pair):
    greedy, _ = both(pair, PROMPTS[:1], {"do_sample": False})
    stop = int(greedy.batch["responses"][0, 2])
    a, b = both(pair, PROMPTS[:1], {"do_sample": False, "eos_token_id": [2, stop]}, stop_token_ids=[stop])
    assert_same_output(a, b)
    assert a.batch["responses"][0, 2] == stop and a.batch["attention_mask"][0, -12:].tolist() == [1] * 3 + [0] * 9


def test_validation_uses_val_kwargs(pair):
    greedy, _ = both(pair, PROMPTS, {"do_sample": False})
    a, b = both(pair, PROMPTS, {"do_sample": True, "validate": True})  # val_kwargs.temperature = 0
    assert_same_output(a, b)
    assert torch.equal(a.batch["responses"], greedy.batch["responses"])


def test_generate_from_threads_and_event_loops(pair):
    sglang, _, model_cfg = pair
    expected = sglang.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False})).batch["responses"]
    results, errors = [], []

    def worker():
        try:
            results.append(sglang.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False})))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(torch.equal(r.batch["responses"], expected) for r in results)

    async def inside_a_running_loop():  # what a Jupyter cell is
        sync = sglang.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False}))
        awaited = await sglang.agenerate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False}))
        return sync, awaited

    for out in asyncio.run(inside_a_running_loop()):
        assert torch.equal(out.batch["responses"], expected)


def test_stop_strings_end_generation_as_on_the_embedded_engine(pair):
    """With skip_tokenizer_init SGLang's scheduler has no tokenizer and died on the first stop string: the
    scheduler now checks stop strings with SGLang's own rule, and the result equals the embedded engine's."""
    sglang, _, model_cfg = pair
    greedy, _ = both(pair, PROMPTS, {"do_sample": False})
    tok = model_cfg.tokenizer
    stop = tok.decode(greedy.batch["responses"][0, 3:5].tolist())
    a, b = both(pair, PROMPTS, {"do_sample": False}, stop=[stop])
    assert_same_output(a, b)
    assert int(a.batch["attention_mask"][0, -12:].sum()) < 12  # row 0 stopped early, on the string
    assert stop in tok.decode(a.batch["responses"][0][a.batch["attention_mask"][0, -12:].bool()].tolist())
    again, _ = both(pair, PROMPTS, {"do_sample": False})  # the scheduler is alive and serving
    assert torch.equal(again.batch["responses"], greedy.batch["responses"])


def test_bad_requests_raise_typed_errors_and_serving_goes_on(pair):
    from final.errors import PromptError, SamplingError

    sglang, _, model_cfg = pair
    with pytest.raises(SamplingError, match="random_seed"):
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), seed=3)
    with pytest.raises(SamplingError, match="'temprature'"):
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), temprature=0.5)
    # SGLang 0.5.2 sends an id past the embedding to the scheduler, which dies of it: refused before the call
    vocab = model_cfg.hf_config.vocab_size
    with pytest.raises(PromptError, match=f"prompt 1: token id {vocab + 5} is outside the model's vocabulary"):
        sglang.generate_sequences(dataproto(model_cfg, [[1, 17], [1, vocab + 5]], {"do_sample": False}))
    a, b = both(pair, PROMPTS, {"do_sample": False})
    assert_same_output(a, b)


def test_sampling_with_n_repeats(pair):
    """Rows repeated n times (as veRL's trainer does for rollout.n), sampled at temperature 0.9 / top-p 0.95, and
    SGLang's log-probs of what it sampled. SGLang's sampler draws differently from the embedded engine's, so
    samples are not compared token for token; the log-probs of the drawn tokens are, re-scored by LocalRollout."""
    sglang, local, model_cfg = pair
    n = 3
    data = dataproto(model_cfg, PROMPTS[:2], {"do_sample": True}).repeat(n, interleave=True)
    a = sglang.generate_sequences(data, temperature=0.9, top_p=0.95)
    assert a.batch["responses"].shape == (2 * n, 12) and "rollout_log_probs" in a.batch.keys()
    copies = a.batch["responses"][:n]
    assert not all(torch.equal(copies[0], c) for c in copies[1:])  # the copies were sampled, not repeated
    assert bool((a.batch["rollout_log_probs"] <= 0).all())
