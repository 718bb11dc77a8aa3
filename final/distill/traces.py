"""Tool-use training conversations (`final cartridge traces`): GSM8K problems played through the multi-turn path.

A tool-use cartridge is trained on hard targets: the tokens a model that uses the tool well would write. Which
tokens those are, and what the model reads before each, is decided by the multi-turn rollout, not by a rendering of
our own: veRL's AsyncRolloutRequest re-renders an assistant turn that made a call from the chat template (SmolLM2's
template drops `tool_calls`, so the call is gone from what the next turn reads), appends the tool's message as a
template delta, and so on. So each problem is run through final's real MultiTurnRollout, with the real tools of
tools.yaml (their responses are real), against `ReplayEngine`, which answers each assistant turn with the reference
turn and records what it was asked. A trace row is then exactly (what the model reads, what it must write) for each
turn; turns whose prompt continues the previous turn's stream are one row, with the tool's tokens masked out.

The reference turns of a problem: its worked solution (calculator annotations <<...>> removed) followed by a
well-formed `calc_gsm8k_reward` call with the `#### N` answer, then, after the tool's response, `#### N`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from final.distill.convs import Conversation, append, question_key
from final.errors import ConfigError
from final.tools.gsm8k_task import (TOOL_NAME, Problem, build_messages, load_problems,
                                    template_renders_tools)

ANNOTATION = re.compile(r"<<[^>]*>>")


def reference_turns(problem: Problem) -> list[str]:
    """The assistant turns a tool-using model would write for `problem` (hermes/qwen25 call format)."""
    reasoning = ANNOTATION.sub("", problem.answer.split("####")[0]).strip()
    call = json.dumps({"name": TOOL_NAME, "arguments": {"answer": problem.ground_truth}})
    return [f"{reasoning}\n<tool_call>\n{call}\n</tool_call>", f"#### {problem.ground_truth}"]


class ReplayEngine:
    """The engine dialect (async_generate) answering assistant turn k with replies[k] + EOS, and recording each
    turn's (input ids, output ids): the multi-turn rollout drives it exactly as it drives a model."""

    def __init__(self, tokenizer: Any, eos_token_id: int):
        self.tokenizer, self.eos = tokenizer, eos_token_id
        self.replies: list[str] = []
        self.turns: list[tuple[list[int], list[int]]] = []

    def start(self, replies: Sequence[str]) -> None:
        self.replies, self.turns = list(replies), []

    async def async_generate(self, input_ids: list[int] | None = None, sampling_params: dict | None = None,
                             return_logprob: bool = False, image_data: Any = None, cartridges: Any = None,
                             **kwargs: Any) -> dict:
        if len(self.turns) >= len(self.replies):  # the rollout asked for more turns than the reference has
            raise ConfigError(f"the multi-turn rollout asked for assistant turn {len(self.turns) + 1} of a "
                              f"{len(self.replies)}-turn reference", key="rollout.multi_turn")
        ids = self.tokenizer.encode(self.replies[len(self.turns)], add_special_tokens=False) + [self.eos]
        limit = (sampling_params or {}).get("max_new_tokens", len(ids))
        if len(ids) > limit:
            raise ConfigError(f"a reference turn of {len(ids)} tokens exceeds the {limit} new tokens the rollout "
                              "allows", key="rollout.response_length")
        self.turns.append((list(input_ids), ids))
        meta = {"id": f"replay-{len(self.turns)}", "finish_reason": {"type": "stop", "matched": self.eos},
                "prompt_tokens": len(input_ids), "completion_tokens": len(ids), "cached_tokens": 0}
        if return_logprob:
            meta["output_token_logprobs"] = [(0.0, t, None) for t in ids]
        return {"output_ids": ids, "meta_info": meta}

    def flush_cache(self) -> bool:
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        return None


@dataclass
class TraceRow:
    prompt_ids: list[int]
    answer_ids: list[int]
    mask: list[int]  # per answer token: 1 = the model wrote it (a target), 0 = the tool's message or a template


def trace_rows(turns: Sequence[tuple[list[int], list[int]]]) -> list[TraceRow]:
    """Turns -> training rows: a turn whose input is the previous row's whole stream continues that row (the
    tokens between are not the model's: mask 0); otherwise (a re-rendered turn) it starts a row of its own."""
    rows: list[TraceRow] = []
    for inp, out in turns:
        last = rows[-1] if rows else None
        stream = last.prompt_ids + last.answer_ids if last else None
        if last and inp[:len(stream)] == stream:
            between = inp[len(stream):]
            last.answer_ids += between + out
            last.mask += [0] * len(between) + [1] * len(out)
        else:
            rows.append(TraceRow(list(inp), list(out), [1] * len(out)))
    return rows


class TraceBuilder:
    """MultiTurnRollout (final's, with tools.yaml's tools) over a ReplayEngine, one problem at a time."""

    def __init__(self, config: Any, tokenizer: Any, eos_token_id: int):
        from final.rollout.multi_turn import MultiTurnRollout

        self.tokenizer = tokenizer
        self.engine = ReplayEngine(tokenizer, eos_token_id)
        # no scoring pass (a replay has no logprobs) and no tokenization check (it only logs template diffs)
        rollout = {**config.rollout, "calculate_log_probs": False,
                   "multi_turn": {**config.rollout["multi_turn"], "tokenization_sanity_check_mode": "disable"}}
        self.rollout = MultiTurnRollout(self.engine, replace(config, rollout=rollout).rollout_config(), tokenizer)
        self.schemas = self.rollout.tools.schemas()
        if TOOL_NAME not in [s["function"]["name"] for s in self.schemas]:
            raise ConfigError(f"tool-use traces for GSM8K need the {TOOL_NAME} tool in the tools file",
                              key="--tools")
        self.renders_tools = template_renders_tools(tokenizer, self.schemas)
        self.pad = self.rollout.pad_token_id

    def play(self, problem: Problem) -> tuple[list[TraceRow], list[dict]]:
        """One problem through the rollout: its rows and the tool calls it made (name, arguments, response)."""
        from final.outputs import TRACE_KEY
        from final.prompts import build_dataproto, normalize_prompts
        from final.compat import chat_ids

        messages = build_messages(problem, self.schemas, self.renders_tools)
        ids = chat_ids(self.tokenizer, messages, add_generation_prompt=True)
        batch = build_dataproto([ids], normalize_prompts([messages]), self.pad, [self.engine.eos],
                                meta_info={"do_sample": False, "validate": True, TRACE_KEY: True},
                                non_tensor={"tools_kwargs": [
                                    {TOOL_NAME: {"create_kwargs": {"ground_truth": problem.ground_truth}}}]})
        self.engine.start(reference_turns(problem))
        out = self.rollout.generate_sequences(batch)
        calls = [c for c in out.non_tensor_batch["tool_calls"][0] if "turn" in c]
        return trace_rows(self.engine.turns), calls


def conversation(row: TraceRow, row_id: int, problem: Problem) -> Conversation:
    """A trace row as a training row: hard targets (a one-hot teacher: top-1, logprob 0) on the model's tokens."""
    return Conversation(row_id, row.prompt_ids, row.answer_ids, [[t] for t in row.answer_ids],
                        [[0.0] for _ in row.answer_ids], seed_type="tool_use", question=problem.question,
                        answer=problem.answer, target_start=len(row.prompt_ids),
                        mask=None if all(row.mask) else row.mask)


def build_traces(config: Any, data: str | Path, out: str | Path, *, skip: int = 0, count: int | None = None,
                 progress: bool = True) -> dict:
    """GSM8K problems [skip, skip + count) -> tool-use rows appended to `out` (a file already there is refused:
    its rows would be mixed with another run's). Every problem's call must have run and been rewarded 1.0."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from final.models import eos_token_ids, resolve_model_path

    out = Path(out)
    if out.exists():
        raise ConfigError("exists; traces are written to a new file", key="--out", path=str(out))
    if skip < 0 or (count is not None and count < 1):
        raise ConfigError("--skip must be >= 0 and --count >= 1", key="--skip" if skip < 0 else "--count")
    problems = load_problems(data, None if count is None else skip + count)[skip:]
    if not problems:
        raise ConfigError(f"no problems after skipping {skip}", key="--skip", path=str(data))
    local = resolve_model_path(config.model_path)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or local)
    builder = TraceBuilder(config, tokenizer, eos_token_ids(local, tokenizer)[0])
    rows, seen = [], set()
    for problem in tqdm(problems, desc="traces", unit="problem", disable=not progress):
        key = question_key(problem.question)
        if key in seen:  # one row per question: a repeated one would weigh twice
            continue
        seen.add(key)
        trace, calls = builder.play(problem)
        if not calls or calls[0].get("reward") is None or calls[0].get("error"):
            raise ConfigError(f"problem {problem.index}: the reference call did not run: {calls}", key="--tools")
        rows += [conversation(r, 100 * problem.index + k, problem) for k, r in enumerate(trace)]
    append(out, rows)
    targets = sum(sum(r.mask) if r.mask else len(r.answer_ids) for r in rows)
    return {"out": str(out), "problems": len(seen), "rows": len(rows), "targets": targets,
            "tokens": sum(len(r.ids) for r in rows)}
