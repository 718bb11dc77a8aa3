"""The differential test of the SGLang path: veRL 0.6.0's real SGLangRollout, running on CPU behind the fake
SGLang 0.5.2 (tests/fake_sglang, backed by the embedded engine), must return the DataProto LocalRollout returns."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from sglang_helpers import assert_same_output, configs, dataproto, use_fake_sglang

PROMPTS = [[1, 504, 3456, 28, 253], [1, 17, 99], [1, 2035, 441, 873, 12, 9, 1111, 20, 330, 45, 7, 8], [1, 40000]]


@pytest.fixture(scope="module")
def pair():
    use_fake_sglang()
    from final.rollout.local import LocalRollout
    from final.rollout.sglang import SGLangRollout

    sg_cfg, local_cfg, model_cfg = configs({"val_kwargs": {"temperature": 0}})
    sglang = SGLangRollout(sg_cfg, model_cfg)
    local = OnThread(LocalRollout(local_cfg, model_cfg))
    yield sglang, local, model_cfg
    sglang.shutdown()
    local.shutdown()


class OnThread:
    """LocalRollout the way InferenceEngine drives every rollout: on a RolloutThread (veRL's run_until_complete)."""

    def __init__(self, rollout):
        from final.rollout.thread import RolloutThread

        self.rollout, self.thread = rollout, RolloutThread("test-local")

    def generate_sequences(self, prompts, **kwargs):
        return self.thread.run(self.rollout.generate_sequences, prompts, **kwargs)

    def shutdown(self):
        self.rollout.shutdown()
        self.thread.close()


def both(pair, prompts, meta=None, **kwargs):
    sglang, local, model_cfg = pair
    a = sglang.generate_sequences(dataproto(model_cfg, prompts, meta), **kwargs)
    b = local.generate_sequences(dataproto(model_cfg, prompts, meta), **kwargs)
    return a, b


def test_it_is_verls_own_class_on_the_fake_engine(pair):
    import sglang
    import torch.distributed as dist
    from sglang.srt.entrypoints.engine import Engine
    from verl.workers.rollout.sglang_rollout.sglang_rollout import AsyncEngine, SGLangRollout as VerlSGLangRollout

    rollout = pair[0]
    assert sglang.FAKE and isinstance(rollout._rollout, VerlSGLangRollout)
    assert isinstance(rollout.sglang_engine, AsyncEngine) and isinstance(rollout.sglang_engine, Engine)
    args = rollout.sglang_engine.server_args
    assert (args.tp_size, args.skip_tokenizer_init, args.load_format, args.device) == (1, True, "auto", "cpu")
    assert args.attention_backend == "intel_amx" and args.port != 30000  # our free port, not veRL's fixed one
    assert rollout.sglang_engine.port_args.nccl_port == args.nccl_port
    assert dist.is_initialized() and dist.get_world_size() == 1


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


def test_bad_requests_raise_typed_errors_and_serving_goes_on(pair):
    from final.errors import PromptError, SamplingError

    sglang, _, model_cfg = pair
    with pytest.raises(SamplingError, match="random_seed"):
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), seed=3)
    with pytest.raises(SamplingError, match="'temprature'"):
        sglang.generate_sequences(dataproto(model_cfg, PROMPTS), temprature=0.5)
    with pytest.raises(PromptError, match="vocab size"):
        sglang.generate_sequences(dataproto(model_cfg, [[1, 60000]], {"do_sample": False}))
    a, b = both(pair, PROMPTS, {"do_sample": False})
    assert_same_output(a, b)


def test_sampling_and_n_repeats_match_local():
    """Rows repeated n times (as veRL's trainer does for rollout.n) with temperature/top-p sampling, logprobs off,
    both engines seeded alike: the same samples."""
    use_fake_sglang()
    from final.rollout.local import LocalRollout
    from final.rollout.sglang import SGLangRollout

    sg_cfg, local_cfg, model_cfg = configs({"calculate_log_probs": False, "temperature": 0.9, "top_p": 0.95},
                                           local_seed=7, sglang_args={"random_seed": 7})
    n = 3
    with SGLangRollout(sg_cfg, model_cfg) as sglang:
        local = OnThread(LocalRollout(local_cfg, model_cfg))
        a = sglang.generate_sequences(dataproto(model_cfg, PROMPTS[:2]).repeat(n, interleave=True))
        b = local.generate_sequences(dataproto(model_cfg, PROMPTS[:2]).repeat(n, interleave=True))
        local.shutdown()
    assert_same_output(a, b)
    assert "rollout_log_probs" not in a.batch.keys() and a.batch["responses"].shape[0] == 2 * n
    copies = a.batch["responses"][:n]
    assert not all(torch.equal(copies[0], c) for c in copies[1:])  # the copies were sampled, not repeated
