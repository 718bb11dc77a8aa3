"""Differential test of the multi-turn path: veRL 0.6.0's real SGLangRollout against final's LocalRollout.

Both run the same scripted conversations (an engine that emits tool calls, then answers) and must return equal
DataProtos: every tensor, the messages, the reward scores, and the same engine calls. veRL's code runs for real:
`_initialize_tools` (its tools.yaml loader and SGLang's FunctionCallParser with vocabulary detection),
`_verify_config`, `_init_sampling_params` and the whole `generate_sequences` -> `_req_level_generate_sequences`
path (`_preprocess_prompt_to_async_rollout_requests`, `_async_rollout_a_request`, `_handle_pending_state`,
`_handle_engine_call`, padding, over-sampling), on the real SGLang 0.5.2 package (its qwen25 FunctionCallParser;
kernel stubs from tests/sglang_cpu). The scripted engine stands in for the model where tool calls are needed (a
random model makes none); the constructor's distributed setup becomes a one-rank gloo group.
The last test runs the same path end to end on the real SGLang engine (CPU) against LocalRollout's embedded one.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from final.models import resolve_model_path
from final.rollout.local import LocalRollout
from multiturn_helpers import ScriptedEngine, chat_batch, make_tool_model, rollout_config
from sglang_helpers import CPU_ARGS, use_sglang_cpu

ROOT = Path(__file__).resolve().parents[1]
use_sglang_cpu()  # veRL's sglang_rollout imports SGLang 0.5.2 at module level

CALL = '<tool_call>\n{{"name": "calc_gsm8k_reward", "arguments": {{"answer": "{}"}}}}\n</tool_call>'
SCRIPT = {
    "ALPHA": ["Let me check.\n" + CALL.format("72"), "The answer is #### 72"],  # a tool call, then an answer
    "BETA": ["#### 10"],                                                       # no tool call
    "GAMMA": [CALL.format("3") + "\n" + CALL.format("4"), "x" * 400],          # two calls; answer past the limit
    "DELTA": ["I keep checking " + CALL.format("1")],                          # calls until max_assistant_turns
}
CONVERSATIONS = [[{"role": "user", "content": "ALPHA Natalia sold clips to 48 friends"}],
                 [{"role": "user", "content": "BETA Weng earns $12"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "GAMMA two calls"}],
                 [{"role": "user", "content": "DELTA loop"}]]
TOOLS_KWARGS = [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}} for gt in ("72", "10", "4", "2")]


class AsyncScriptedEngine(ScriptedEngine):
    """SGLang's AsyncEngine has coroutine flush_cache / abort_request; veRL awaits them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborts = 0

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                             return_logprob=False, logprob_start_len=None, cartridges=None):
        if sampling_params.get("max_new_tokens") == 0:  # calculate_log_probs: score the finished sequence
            ids = input_ids.squeeze(0).tolist() if torch.is_tensor(input_ids) else list(input_ids)
            self.calls.append({"input_ids": ids, "sampling_params": dict(sampling_params), "text": "<score>"})
            logprobs = [(None if i == 0 else -0.01 * (t % 97), t, None) for i, t in enumerate(ids)]
            return {"output_ids": [], "meta_info": {"input_token_logprobs": logprobs,
                                                    "finish_reason": {"type": "length", "length": 0}}}
        return await super().async_generate(prompt, sampling_params, input_ids, image_data, return_logprob,
                                            logprob_start_len, cartridges)

    async def flush_cache(self):
        self.flushes += 1

    async def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborts += 1


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import torch.distributed as dist
    import verl.workers.rollout.schemas as schemas
    from verl.workers.rollout.sglang_rollout import sglang_rollout

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    path = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("tm") / "m")
    # veRL's rollout takes asyncio.get_event_loop() on the calling thread, as a veRL worker's main thread has one;
    # an earlier asyncio.run() in this process leaves the main thread with none (and get_event_loop then raises).
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield sglang_rollout, AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path), path
    asyncio.set_event_loop(None)
    loop.close()
    if created:
        dist.destroy_process_group()


def verl_rollout(module, tok, hf_config, config):
    """veRL's SGLangRollout with its own tool/config/sampling setup; CUDA-only pieces replaced (see module doc)."""
    from torch.distributed.device_mesh import init_device_mesh

    rollout = module.SGLangRollout.__new__(module.SGLangRollout)
    rollout.config = config
    (rollout._tool_schemas, rollout._tool_map, rollout._tool_call_parser_type, rollout._sgl_tools,
     rollout._function_call_parser) = rollout._initialize_tools(config, tok)
    rollout.interaction_map = rollout._initialize_interactions(config)
    rollout._device_mesh_cpu = init_device_mesh("cpu", mesh_shape=(1, 1, 1), mesh_dim_names=["dp", "tp", "pp"])
    rollout._rank = rollout._tp_rank = 0
    rollout._tp_size = 1
    rollout._verify_config(model_hf_config=hf_config)
    rollout._init_sampling_params()
    rollout.processing_class, rollout.pad_token_id = tok, tok.pad_token_id
    rollout._engine = AsyncScriptedEngine(tok, SCRIPT)
    return rollout


def local_rollout(path: str, tok, config) -> LocalRollout:
    from verl.workers.config import HFModelConfig

    return LocalRollout(config, HFModelConfig(path=path), engine=AsyncScriptedEngine(tok, SCRIPT))


def assert_same(ours, theirs, ours_engine, theirs_engine):
    assert set(ours.batch.keys()) == set(theirs.batch.keys())
    for key in theirs.batch.keys():
        assert torch.equal(ours.batch[key], theirs.batch[key]), key
    assert set(ours.non_tensor_batch) == set(theirs.non_tensor_batch) == {"messages", "reward_scores", "request_id"}
    assert list(ours.non_tensor_batch["messages"]) == list(theirs.non_tensor_batch["messages"])
    assert list(ours.non_tensor_batch["reward_scores"]) == list(theirs.non_tensor_batch["reward_scores"])
    calls = lambda e: sorted((c["input_ids"], sorted(c["sampling_params"].items())) for c in e.calls)  # noqa: E731
    assert calls(ours_engine) == calls(theirs_engine)
    # veRL flushes when the call ends; LocalRollout does not (its engine's prefix cache is emptied by a weight
    # update itself, so a conversation going on in the next call keeps its history: flush_after_multi_turn)
    assert theirs_engine.flushes == 1 and ours_engine.flushes == 0


@pytest.mark.parametrize("meta", [{"do_sample": False, "validate": True}, {"do_sample": True}],
                         ids=["greedy-validate", "sample-train"])
@pytest.mark.parametrize("calculate_log_probs", [False, True], ids=["plain", "logprobs"])
def test_same_dataproto_as_verl_sglang_rollout(env, meta, calculate_log_probs):
    module, tok, hf_config, path = env
    settings = dict(multi_turn={"tool_config_path": str(ROOT / "tools.yaml"), "max_parallel_calls": 2,
                                "max_assistant_turns": 3}, calculate_log_probs=calculate_log_probs)
    theirs_rollout = verl_rollout(module, tok, hf_config, rollout_config(**settings))
    assert theirs_rollout._tool_call_parser_type == "qwen25"  # SGLang's detection on the tool model's vocabulary
    ours_rollout = local_rollout(path, tok, rollout_config(**settings))

    theirs = theirs_rollout.generate_sequences(chat_batch(tok, CONVERSATIONS, TOOLS_KWARGS, **meta))
    ours = ours_rollout.generate_sequences(chat_batch(tok, CONVERSATIONS, TOOLS_KWARGS, **meta))
    assert_same(ours, theirs, ours_rollout.engine, theirs_rollout._engine)
    # the conversations really went through tools: ALPHA right (1.0), BETA never called, GAMMA's last answer right
    assert [r["calc_gsm8k_reward"] for r in theirs.non_tensor_batch["reward_scores"]] == [1.0, 0, 1.0, 0]
    assert int(theirs.batch["response_mask"][0].sum()) < int(theirs.batch["attention_mask"][0, -128:].sum())


def test_same_dataproto_when_the_context_runs_out(env):
    module, tok, hf_config, path = env
    # ~240 prompt tokens (the tool schema is in the system prompt), 64 response tokens, 400 tokens of context
    settings = dict(multi_turn={"tool_config_path": str(ROOT / "tools.yaml"), "max_parallel_calls": 2},
                    prompt_length=336, response_length=64, max_model_len=400)
    theirs_rollout = verl_rollout(module, tok, hf_config, rollout_config(**settings))
    ours_rollout = local_rollout(path, tok, rollout_config(**settings))
    rows, kwargs = [CONVERSATIONS[3], CONVERSATIONS[2]], [TOOLS_KWARGS[3], TOOLS_KWARGS[2]]
    theirs = theirs_rollout.generate_sequences(chat_batch(tok, rows, kwargs, prompt_length=336, do_sample=False))
    ours = ours_rollout.generate_sequences(chat_batch(tok, rows, kwargs, prompt_length=336, do_sample=False))
    assert_same(ours, theirs, ours_rollout.engine, theirs_rollout._engine)
    # later turns were clipped by max_model_len (max_new_tokens < response_length); responses cut at 64 tokens
    assert min(c["sampling_params"]["max_new_tokens"] for c in theirs_rollout._engine.calls) < 64
    assert theirs.batch["attention_mask"][:, -64:].sum(-1).tolist() == [64, 64]


def test_real_sglang_engine_matches_local_end_to_end(env):
    """veRL's multi-turn path on the real SGLang 0.5.2 engine (CPU, through final's SGLangRollout) and final's on
    the embedded engine, each running the tool model for real: tools offered, greedy, log-probs by re-scoring
    (veRL's [1, L] tensor call), masks and messages. A random model calls no tool, so this checks the engines and
    the plumbing; the scripted tests above check the tool-calling state machine."""
    from verl.workers.config import HFModelConfig

    from final.rollout.sglang.rollout_052 import SGLangRollout

    _, tok, _, path = env
    settings = dict(multi_turn={"tool_config_path": str(ROOT / "tools.yaml"), "max_assistant_turns": 2},
                    calculate_log_probs=True, dtype="float32", response_length=16)
    local = LocalRollout(rollout_config(**settings), HFModelConfig(path=path))
    sglang_config = rollout_config(name="sglang", engine_kwargs={"sglang": CPU_ARGS}, **settings)
    rows, kwargs = CONVERSATIONS[:3], TOOLS_KWARGS[:3]
    try:
        with SGLangRollout(sglang_config, HFModelConfig(path=path)) as sglang:
            theirs = sglang.generate_sequences(chat_batch(tok, rows, kwargs, do_sample=False))
        ours = local.generate_sequences(chat_batch(tok, rows, kwargs, do_sample=False))
    finally:
        local.shutdown()
    assert set(ours.batch.keys()) == set(theirs.batch.keys()) and "rollout_log_probs" in theirs.batch.keys()
    for key in theirs.batch.keys():
        if theirs.batch[key].is_floating_point():
            torch.testing.assert_close(ours.batch[key], theirs.batch[key], rtol=0, atol=1e-4, msg=key)
        else:
            assert torch.equal(ours.batch[key], theirs.batch[key]), key
    assert list(ours.non_tensor_batch["messages"]) == list(theirs.non_tensor_batch["messages"])
    assert int(theirs.batch["response_mask"].sum()) > 0
