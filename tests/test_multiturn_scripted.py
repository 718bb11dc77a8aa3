"""The multi-turn state machine (final/rollout/multi_turn.py) driven by scripted conversations: veRL's token layout
on the normal path, and every run-time failure recorded in the conversation instead of crashing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from final.errors import PromptError
from final.models import resolve_model_path
from final.rollout.multi_turn import MultiTurnRollout
from multiturn_helpers import ScriptedEngine, chat_batch, make_tool_model, rollout_config
from multiturn_tools import schema

P, R = 256, 128  # prompt_length, response_length of rollout_config()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    import verl.workers.rollout.schemas as schemas

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)  # veRL's tokenization sanity-check diffs
    path = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("tm") / "m")
    return AutoTokenizer.from_pretrained(path)


def call(name: str, **args) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def make(tok, tmp_path: Path, script: dict, tools: list[dict] | None = None, **config):
    tools = tools or [{"class_name": "multiturn_tools.EchoTool", "config": {"type": "native"},
                       "tool_schema": schema("echo")}]
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    multi_turn = {"tool_config_path": str(path), **config.pop("multi_turn", {})}
    engine = ScriptedEngine(tok, script)
    return MultiTurnRollout(engine, rollout_config(multi_turn=multi_turn, **config), tok), engine


def run(rollout, tok, users: list[str], tools_kwargs: list[dict], observer=None, **meta):
    batch = chat_batch(tok, [[{"role": "user", "content": u}] for u in users], tools_kwargs, final_tool_trace=True,
                       **meta)
    return rollout.generate_sequences(batch, observer=observer)


class Recorder:
    """A final.rollout.base.Observer that keeps what it sees."""

    def __init__(self):
        self.rows, self.events = 0, []

    def row_done(self) -> None:
        self.rows += 1

    def tool_event(self, event: dict) -> None:
        self.events.append(event)


def segments(tok, out, i: int) -> list[tuple[int, str]]:
    """(mask, text) runs of row i's response: 1 = written by the model, 0 = tool/template tokens."""
    width = out.batch["prompts"].shape[-1]  # prompt_length, or more: veRL only warns about longer prompts
    resp, mask, attn = out.batch["responses"][i], out.batch["response_mask"][i], out.batch["attention_mask"][i, width:]
    runs: list[tuple[int, list[int]]] = []
    for t, m, a in zip(resp.tolist(), mask.tolist(), attn.tolist()):
        if not a:
            break
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    return [(m, tok.decode(ids)) for m, ids in runs]


def asked(engine: ScriptedEngine, key: str) -> list[dict]:
    return [c for c in engine.calls if key in c["text"]]


def tool_texts(out, i: int) -> list[str]:
    return [m.content for m in out.non_tensor_batch["messages"][i]["messages"] if m.role == "tool"]


def test_tool_call_then_answer_has_verl_layout(tok, tmp_path):
    rollout, engine = make(tok, tmp_path, {"ALPHA": ["Let me check.\n" + call("echo", x="1"), "Done."],
                                           "BETA": ["No tools needed."]})
    kwargs = [{"echo": {"create_kwargs": {"ground_truth": "7"}, "execute_kwargs": {"mode": "FAST"},
                        "calc_reward_kwargs": {"k": 1}, "release_kwargs": {"r": 2}}}, {"echo": {}}]
    out = run(rollout, tok, ["ALPHA question", "BETA question"], kwargs)

    assert segments(tok, out, 0) == [
        (1, 'Let me check.\n<tool_call>\n{"name": "echo", "arguments": {"x": "1"}}\n</tool_call><|im_end|>\n'),
        (0, '<|im_start|>user\n<tool_response>\necho {"x": "1"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'),
        (1, "Done.<|im_end|>"),
    ]
    assert segments(tok, out, 1) == [(1, "No tools needed.<|im_end|>")]
    b = out.batch
    assert b["responses"].shape == b["response_mask"].shape == (2, R) and b["input_ids"].shape == (2, P + R)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=-1))
    assert not b["response_mask"][b["attention_mask"][:, P:] == 0].any()  # padding is never a model token
    # positions continue through the response; the second engine call saw the whole history, token for token
    valid = b["attention_mask"][0].bool()
    assert torch.equal(b["position_ids"][0][valid], torch.arange(int(valid.sum())))
    second = asked(engine, "ALPHA")[1]["input_ids"]
    assert second == b["input_ids"][0][valid].tolist()[:len(second)]
    assert len(second) == int(valid.sum()) - len(tok.encode("Done.", add_special_tokens=False)) - 1

    msgs = out.non_tensor_batch["messages"][0]["messages"]
    assert [(m.role, m.content, m.tool_calls) for m in msgs] == [
        ("user", "ALPHA question", None), ("assistant", "Let me check.", None),
        ("tool", 'echo {"x": "1"}', None), ("assistant", "Done.", None)]
    assert list(out.non_tensor_batch["reward_scores"]) == [{"echo": 0.25, "user_turn_rewards": []}] * 2
    assert len(set(out.non_tensor_batch["request_id"])) == 2
    assert out.non_tensor_batch["tool_calls"][0] == [{"turn": 1, "name": "echo", "arguments": {"x": "1"},
                                                      "response": 'echo {"x": "1"}', "reward": 0.5, "error": None,
                                                      "message_index": 1}]
    # BaseTool lifecycle with this row's tools_kwargs; greedy params because meta_info do_sample=False
    log = rollout.tools["echo"].log
    rid = out.non_tensor_batch["request_id"][0]
    assert ("create", rid, {"ground_truth": "7"}) in log and ("execute", rid, {"x": "1"}, {"mode": "FAST"}) in log
    assert ("calc_reward", rid, {"k": 1}) in log and ("release", rid, {"r": 2}) in log
    assert all(c["sampling_params"]["temperature"] == 0 for c in engine.calls)


def test_row_without_tools_is_not_offered_them(tok, tmp_path):
    rollout, engine = make(tok, tmp_path, {"ALPHA": ["hi"], "BETA": ["hi"]})
    run(rollout, tok, ["ALPHA", "BETA"], [{"echo": {}}, {}])
    assert "<tools>" in asked(engine, "ALPHA")[0]["text"] and "<tools>" not in asked(engine, "BETA")[0]["text"]


@pytest.mark.parametrize("reply, error", [
    ('<tool_call>\n{"name": "echo", "arguments": {x: 1}}\n</tool_call>', "could not parse tool call: invalid JSON"),
    (call("nope", x="1"), "unknown tool 'nope'; available tools: echo"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "non-empty string 'name'"),
])
def test_broken_calls_are_answered_with_an_error_and_the_loop_continues(tok, tmp_path, reply, error):
    rollout, engine = make(tok, tmp_path, {"QQ": [reply, "Sorry."]})
    out = run(rollout, tok, ["QQ"], [{"echo": {}}])
    [text] = tool_texts(out, 0)
    assert text.startswith("Error: ") and error in text and len(engine.calls) == 2
    segs = segments(tok, out, 0)
    assert segs[0] == (1, reply + "<|im_end|>")  # only broken calls: the model's own tokens are kept
    assert segs[-1] == (1, "Sorry.<|im_end|>")
    assert error in "Error: " + out.non_tensor_batch["tool_calls"][0][0]["error"]


def test_unclosed_call_at_the_end_still_runs(tok, tmp_path):
    rollout, _ = make(tok, tmp_path, {"QQ": ['<tool_call>\n{"name": "echo", "arguments": {"x": "2"}}', "ok"]})
    out = run(rollout, tok, ["QQ"], [{"echo": {}}])
    assert tool_texts(out, 0) == ['echo {"x": "2"}']


def tool(cls: str, name: str, **extra) -> dict:
    return {"class_name": f"multiturn_tools.{cls}", "config": {"type": "native", **extra.pop("config", {})},
            "tool_schema": schema(name), **extra}


def test_raising_hanging_and_bad_tools_are_recorded(tok, tmp_path):
    tools = [tool("RaisingTool", "boom"), tool("HangingTool", "hang", timeout_s=0.2),
             tool("BadReturnTool", "bad"), tool("EchoTool", "echo")]
    script = {"QQ": ["\n".join([call("boom", x="1"), call("hang", x="1"), call("bad", x="1")]), "fine"],
              "AGAIN": ["after the failures the engine still serves"]}
    rollout, engine = make(tok, tmp_path, script, tools, multi_turn={"max_parallel_calls": 3}, response_length=512)
    out = run(rollout, tok, ["QQ", "AGAIN"], [{"boom": {}, "hang": {}, "bad": {}}, {"echo": {}}])
    assert tool_texts(out, 0) == ["Error: tool 'boom' execute raised RuntimeError: boom",
                                  "Error: tool 'hang' execute timed out after 0.2s",
                                  "Error: execute must return (ToolResponse, reward, metrics), got str"]
    assert segments(tok, out, 0)[-1] == (1, "fine<|im_end|>")
    # RaisingTool.calc_reward raises too: reward 0 and the failure is in the trace
    assert out.non_tensor_batch["reward_scores"][0]["boom"] == 0.0
    failure = {"name": "boom", "stage": "calc_reward", "error": "tool 'boom' calc_reward raised ValueError: no reward today"}
    assert failure in out.non_tensor_batch["tool_calls"][0]
    assert segments(tok, out, 1) == [(1, "after the failures the engine still serves<|im_end|>")]


@pytest.mark.parametrize("side, expected", [
    ("middle", "HEAD" + "x" * 46 + "...(truncated)..." + "x" * 46 + "TAIL"),
    ("left", "HEAD" + "x" * 96 + "...(truncated)"),
    ("right", "(truncated)..." + "x" * 96 + "TAIL"),
])
def test_megabyte_tool_output_is_truncated(tok, tmp_path, side, expected):
    rollout, _ = make(tok, tmp_path, {"QQ": [call("big", x="1"), "ok"]}, [tool("BigTool", "big")],
                      multi_turn={"max_tool_response_length": 100, "tool_response_truncate_side": side})
    out = run(rollout, tok, ["QQ"], [{"big": {}}])
    assert tool_texts(out, 0) == [expected]


def test_calls_of_one_turn_run_concurrently(tok, tmp_path):
    # RendezvousTool only returns once both calls are inside execute at the same time
    rollout, _ = make(tok, tmp_path, {"QQ": [call("meet", x="a") + "\n" + call("meet", x="b"), "met"]},
                      [tool("RendezvousTool", "meet", timeout_s=5, config={"expected": 2})],
                      multi_turn={"max_parallel_calls": 2})
    out = run(rollout, tok, ["QQ"], [{"meet": {}}])
    assert tool_texts(out, 0) == ["met None", "met None"]


def test_more_calls_than_max_parallel_calls(tok, tmp_path):
    rollout, _ = make(tok, tmp_path, {"QQ": [call("echo", x="1") + "\n" + call("echo", x="2"), "ok"]})
    out = run(rollout, tok, ["QQ"], [{"echo": {}}])  # max_parallel_calls defaults to 1 (veRL)
    assert tool_texts(out, 0) == ['echo {"x": "1"}', "Error: call to 'echo' skipped: at most 1 tool call(s) run "
                                                     "per turn (rollout.multi_turn.max_parallel_calls)"]
    assert [e[0] for e in rollout.tools["echo"].log].count("execute") == 1


def test_max_assistant_turns(tok, tmp_path):
    rollout, engine = make(tok, tmp_path, {"QQ": [call("echo", x="AGAIN")]}, multi_turn={"max_assistant_turns": 3})
    out = run(rollout, tok, ["QQ"], [{"echo": {}}])
    # veRL leaves the loop after the third generation: the last turn's calls never run and keep their tool_calls
    assert len(engine.calls) == 3 and len(tool_texts(out, 0)) == 2
    assert [m for m, _ in segments(tok, out, 0)] == [1, 0, 1, 0, 1]
    assert out.non_tensor_batch["messages"][0]["messages"][-1].tool_calls[0].function.name == "echo"


def test_max_user_turns_bounds_tool_rounds(tok, tmp_path):
    rollout, engine = make(tok, tmp_path, {"QQ": [call("echo", x="AGAIN")]}, multi_turn={"max_user_turns": 1})
    out = run(rollout, tok, ["QQ"], [{"echo": {}}])
    assert len(engine.calls) == 2 and len(tool_texts(out, 0)) == 1
    assert out.non_tensor_batch["messages"][0]["messages"][-1].tool_calls is None


def test_max_model_len_and_response_length(tok, tmp_path):
    long = "word " * 60
    rollout, engine = make(tok, tmp_path, {"QQ": [long + call("echo", x="1")]}, response_length=64,
                           max_model_len=256 + 64)
    out = run(rollout, tok, ["QQ"], [{"echo": {}}])
    b = out.batch
    assert b["responses"].shape == (1, 64) and int(b["attention_mask"].sum()) <= 256 + 64
    # the first reply is cut at max_new_tokens (finish "length"): veRL stops there
    assert len(engine.calls) == 1 and engine.calls[0]["sampling_params"]["max_new_tokens"] == 64
    assert int(b["response_mask"].sum()) == 64


def test_cartridges_reach_the_engine(tok, tmp_path):
    rollout, engine = make(tok, tmp_path, {"ALPHA": [call("echo", x="1"), "ok"], "BETA": ["ok"]})
    batch = chat_batch(tok, [[{"role": "user", "content": "ALPHA"}], [{"role": "user", "content": "BETA"}]],
                       [{"echo": {}}, {"echo": {}}])
    batch.non_tensor_batch["cartridges"] = chat_batch(tok, [[{"role": "user", "content": "x"}]] * 2).non_tensor_batch[
        "raw_prompt"].copy()
    batch.non_tensor_batch["cartridges"][:] = [("doc-a",), ()]
    rollout.generate_sequences(batch)
    assert [c["cartridges"] for c in asked(engine, "ALPHA")] == [("doc-a",), ("doc-a",)]
    assert [c["cartridges"] for c in asked(engine, "BETA")] == [None]


def test_bad_rows_are_typed_errors(tok, tmp_path):
    rollout, _ = make(tok, tmp_path, {"QQ": ["ok"]})
    batch = chat_batch(tok, [[{"role": "user", "content": "QQ"}]])
    with pytest.raises(PromptError, match="tools_kwargs"):
        rollout.generate_sequences(batch)
    with pytest.raises(PromptError) as err:
        run(rollout, tok, ["QQ", "QQ"], [{"echo": {}}, {"nope": {}}])
    assert err.value.index == 1 and "unknown tools ['nope']" in str(err.value)
    with pytest.raises(PromptError, match="must be a dict"):
        run(rollout, tok, ["QQ"], [{"echo": "create"}])


def test_over_sample_rate_pads_the_slowest_requests(tok, tmp_path):
    tools = [tool("HangingTool", "hang", timeout_s=30), tool("EchoTool", "echo")]
    rollout, _ = make(tok, tmp_path, {"FAST": ["done"], "SLOW": [call("hang", x="1")]}, tools,
                      over_sample_rate=0.5)
    out = run(rollout, tok, ["SLOW", "FAST"], [{"hang": {}}, {"echo": {}}], do_sample=True)
    b = out.batch
    # veRL's _create_padding_request: pad ids, zero masks, empty rewards for the cancelled request
    assert not b["attention_mask"][0].any() and not b["response_mask"][0].any()
    assert (b["responses"][0] == tok.pad_token_id).all() and out.non_tensor_batch["reward_scores"][0] == {}
    assert segments(tok, out, 1) == [(1, "done<|im_end|>")]


def test_conversation_rows_and_live_events(tok, tmp_path):
    from final.tools.outputs import conversation_rows, describe_event

    rollout, _ = make(tok, tmp_path, {"ALPHA": ["Checking.\n" + call("echo", x="1") + "\n" + call("nope"), "Done."]},
                      multi_turn={"max_parallel_calls": 2})
    seen = Recorder()
    out = run(rollout, tok, ["ALPHA"], [{"echo": {}}], observer=seen)
    events = seen.events
    assert seen.rows == 1
    [row] = conversation_rows(out, tok)
    assert row.messages == [
        {"role": "user", "content": "ALPHA"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"name": "echo", "arguments": {"x": "1"}},
                        {"name": "nope", "arguments": {}, "error": "unknown tool 'nope'; available tools: echo"}]},
        {"role": "tool", "content": 'echo {"x": "1"}'},
        {"role": "tool", "content": "Error: unknown tool 'nope'; available tools: echo"},
        {"role": "assistant", "content": "Done."}]
    assert row.final_text == "Done." and row.num_turns == 2 and row.rewards == {"echo": 0.25, "user_turn_rewards": []}
    assert row.response_text.endswith("Done.") and "<|im_end|>" not in row.response_text  # NaiveRewardManager's view
    assert row.completion_tokens == sum(row.response_mask) == int(out.batch["response_mask"][0].sum())
    assert set(row.to_metadata()) == {"messages", "response_text", "prompt_ids", "response_ids", "response_mask",
                                      "rewards", "num_turns", "tool_calls", "completion_tokens"}
    width = out.batch["prompts"].shape[1]  # the prompt the conversation was sampled after, without its left pad
    assert row.prompt_ids == out.batch["input_ids"][0, :width][out.batch["attention_mask"][0, :width].bool()].tolist()
    assert [(e["type"], e.get("name")) for e in events] == [
        ("assistant", None), ("tool_call", "echo"), ("tool_call", "nope"), ("tool_result", "echo"),
        ("tool_result", "nope"), ("assistant", None), ("done", None)]
    assert events[-2]["text"] == "Done." and events[3]["response"] == 'echo {"x": "1"}' and events[-1]["turns"] == 2
    assert [describe_event(e) for e in events] == [
        None, '  -> echo({"x": "1"})', "  -> nope({})", '  <- echo: echo {"x": "1"}',
        "  <- nope: Error: unknown tool 'nope'; available tools: echo", None, None]


def test_one_event_loop_across_batches_and_none_inside_a_running_loop(tok, tmp_path):
    import asyncio

    from final.errors import EngineError

    rollout, _ = make(tok, tmp_path, {"QQ": [call("echo", x="1"), "ok"]})
    run(rollout, tok, ["QQ"], [{"echo": {}}])
    run(rollout, tok, ["QQ"], [{"echo": {}}])
    assert len(rollout.tools["echo"].loops) == 1  # tools may keep loop-bound state between batches, as in veRL

    async def inside():
        return run(rollout, tok, ["QQ"], [{"echo": {}}])

    with pytest.raises(EngineError, match="inside a running event loop"):
        asyncio.run(inside())
