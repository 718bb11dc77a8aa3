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

Student rows (`--student CART`, DAgger): a cartridge trained on reference turns alone still loops at greedy inside
its own reasoning, in states the references never show it, and never reaches the call. So the model with that
cartridge writes its own first turn; the row keeps its reasoning as context (mask 0: not a target), cut at the
reference solution's line count (or where it called or answered), and supervises what a tool-using model writes
from there: the call, with the last number it reasoned to, then the closing answer. The closing answer honours the
tool's verdict, which the row shows the model: the submitted number where the tool accepted it (reward=1.0), else
the expert's, the problem's answer (`verdict_turns`; repeating a number the tool rejected would teach the cartridge
to ignore the tool).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from final.compat import chat_ids
from final.errors import ConfigError
from final.models import eos_token_ids, resolve_model_path
from final.outputs import TRACE_KEY
from final.prompts import build_dataproto, normalize_prompts
from final.rollout.multi_turn import MultiTurnRollout
from final.tools.gsm8k_task import (TOOL_NAME, Problem, build_messages, load_problems,
                                    template_renders_tools)
from final.training.rows import Conversation, append, first_of_each_question

ANNOTATION = re.compile(r"<<[^>]*>>")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
CALL_OPEN = "<tool_call>"
VERDICT = re.compile(r"reward=(-?\d+(?:\.\d+)?)")  # in the tool's response text: what the model reads

# A reference turn: (the model's own text, read but not a target; the text it must write)
Turn = tuple[str, str]


def solution_lines(problem: Problem) -> list[str]:
    return ANNOTATION.sub("", problem.answer.split("####")[0]).strip().split("\n")


def call_turns(answer: str) -> tuple[str, str]:
    """A well-formed call (hermes/qwen25 format) submitting `answer`, and the closing answer turn."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"answer": answer}})
    return f"{CALL_OPEN}\n{call}\n</tool_call>", f"#### {answer}"


def reference_turns(problem: Problem) -> list[str]:
    """The assistant turns a tool-using model would write for `problem`."""
    call, closing = call_turns(problem.ground_truth)
    return ["\n".join(solution_lines(problem)) + "\n" + call, closing]


def student_turns(problem: Problem, text: str, finished: bool) -> list[Turn]:
    """The student's own first turn `text` (finished: it ended by itself, not at the token limit) -> reference turns
    that keep its reasoning as context: at most as many lines as the worked solution, none after a call or an
    answer line, none cut by the limit; then the call with the last number in what is kept."""
    head, called = text.split(CALL_OPEN)[0], CALL_OPEN in text
    lines = head.split("\n")
    if not finished and not called:
        lines = lines[:-1]  # the token limit cut the last line
    kept: list[str] = []
    budget = len(solution_lines(problem))  # non-empty lines the student may keep
    for line in lines:
        if line.lstrip().startswith("####") or budget == 0:
            break
        kept.append(line)
        budget -= bool(line.strip())
    reasoning = "\n".join(kept).strip()
    numbers = NUMBER.findall(reasoning)
    answer = numbers[-1].replace(",", "") if numbers else problem.ground_truth
    call, closing = call_turns(answer)
    return [(reasoning + "\n" if reasoning else "", call), ("", closing)]


def accepted(call: dict) -> bool:
    """Whether the tool's response (the text the model reads after its call) says the submission was right."""
    found = VERDICT.search(str(call.get("response", "")))
    return found is not None and float(found.group(1)) > 0


def verdict_turns(problem: Problem, turns: list[Turn], call: dict) -> list[Turn]:
    """`turns` (student_turns') with the closing answer the tool's verdict on the call asks for: unchanged where
    the tool accepted the submitted number, else the problem's own answer."""
    if accepted(call):
        return turns
    return turns[:-1] + [("", call_turns(problem.ground_truth)[1])]


class ReplayEngine:
    """The engine dialect (async_generate) answering assistant turn k with replies[k] + EOS, and recording each
    turn's (input ids, output ids): the multi-turn rollout drives it exactly as it drives a model."""

    def __init__(self, tokenizer: Any, eos_token_id: int):
        self.tokenizer, self.eos = tokenizer, eos_token_id
        self.replies: list[Turn] = []
        self.turns: list[tuple[list[int], list[int], int]] = []  # (input ids, output ids, leading non-targets)

    def start(self, replies: Sequence[str | Turn]) -> None:
        self.replies = [("", r) if isinstance(r, str) else r for r in replies]
        self.turns = []

    async def async_generate(self, input_ids: list[int] | None = None, sampling_params: dict | None = None,
                             return_logprob: bool = False, image_data: Any = None, cartridges: Any = None,
                             **kwargs: Any) -> dict:
        if len(self.turns) >= len(self.replies):  # the rollout asked for more turns than the reference has
            raise ConfigError(f"the multi-turn rollout asked for assistant turn {len(self.turns) + 1} of a "
                              f"{len(self.replies)}-turn reference", key="rollout.multi_turn")
        own, write = self.replies[len(self.turns)]
        ids = self.tokenizer.encode(own + write, add_special_tokens=False) + [self.eos]
        own_ids = self.tokenizer.encode(own, add_special_tokens=False) if own else []
        context = next((i for i, (a, b) in enumerate(zip(own_ids, ids)) if a != b), len(own_ids))
        limit = (sampling_params or {}).get("max_new_tokens", len(ids))
        if len(ids) > limit:
            raise ConfigError(f"a reference turn of {len(ids)} tokens exceeds the {limit} new tokens the rollout "
                              "allows", key="rollout.response_length")
        self.turns.append((list(input_ids), ids, context))
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


def trace_rows(turns: Sequence[tuple]) -> list[TraceRow]:
    """Turns (input ids, output ids[, how many leading output ids are context, not targets]) -> training rows: a
    turn whose input is the previous row's whole stream continues that row (the tokens between are not the model's:
    mask 0); otherwise (a re-rendered turn) it starts a row of its own."""
    rows: list[TraceRow] = []
    for inp, out, *rest in turns:
        context = rest[0] if rest else 0
        mask = [0] * context + [1] * (len(out) - context)
        last = rows[-1] if rows else None
        stream = last.prompt_ids + last.answer_ids if last else None
        if last and inp[:len(stream)] == stream:
            between = inp[len(stream):]
            last.answer_ids += between + out
            last.mask += [0] * len(between) + mask
        else:
            rows.append(TraceRow(list(inp), list(out), mask))
    return rows


class TraceBuilder:
    """MultiTurnRollout (final's, with tools.yaml's tools) over a ReplayEngine, one problem at a time."""

    def __init__(self, config: Any, tokenizer: Any, eos_token_id: int):
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

    def prompt_ids(self, problem: Problem) -> list[int]:
        return chat_ids(self.tokenizer, build_messages(problem, self.schemas, self.renders_tools),
                        add_generation_prompt=True)

    def play_student(self, problem: Problem, text: str, finished: bool) -> tuple[list[TraceRow], list[dict]]:
        """play() with the student's first turn `text` kept as context (student_turns), then, where the tool
        rejected its number, played again with the closing answer the verdict asks for (verdict_turns)."""
        turns = student_turns(problem, text, finished)
        trace, calls = self.play(problem, turns)
        if calls and not accepted(calls[0]):
            trace, calls = self.play(problem, verdict_turns(problem, turns, calls[0]))
        return trace, calls

    def play(self, problem: Problem, turns: Sequence[str | Turn] | None = None) -> tuple[list[TraceRow], list[dict]]:
        """One problem through the rollout, answered with `turns` (default: its reference turns): its rows and the
        tool calls it made (name, arguments, response)."""
        messages = build_messages(problem, self.schemas, self.renders_tools)
        batch = build_dataproto([self.prompt_ids(problem)], normalize_prompts([messages]), self.pad, [self.engine.eos],
                                meta_info={"do_sample": False, "validate": True, TRACE_KEY: True},
                                non_tensor={"tools_kwargs": [
                                    {TOOL_NAME: {"create_kwargs": {"ground_truth": problem.ground_truth}}}]})
        self.engine.start(reference_turns(problem) if turns is None else turns)
        out = self.rollout.generate_sequences(batch)
        calls = [c for c in out.non_tensor_batch["tool_calls"][0] if "turn" in c]
        return trace_rows(self.engine.turns), calls


def conversation(row: TraceRow, row_id: int, problem: Problem) -> Conversation:
    """A trace row as a training row: hard targets (a one-hot teacher: top-1, logprob 0) on the model's tokens."""
    return Conversation(row_id, row.prompt_ids, row.answer_ids, [[t] for t in row.answer_ids],
                        [[0.0] for _ in row.answer_ids], seed_type="tool_use", question=problem.question,
                        answer=problem.answer, target_start=len(row.prompt_ids),
                        mask=None if all(row.mask) else row.mask)


STUDENT_ROW_IDS = 50  # a student row's id is 100 * problem + 50 + k: files of both kinds can be concatenated


def student_answers(student: tuple[Any, str], builder: "TraceBuilder", problems: Sequence[Problem],
                    max_tokens: int, progress: bool = True) -> list[tuple[str, bool]]:
    """Each problem's first turn written greedily by the model behind the cartridge file (InferenceEngine, any
    backend that serves cartridges): (text, whether it ended by itself)."""
    inference, path = student
    cid = inference.load_cartridge(path=str(path))
    try:
        out = inference.generate([builder.prompt_ids(p) for p in problems], cartridge=cid, temperature=0.0,
                                 max_tokens=max_tokens, progress=progress)
    finally:
        inference.unload_cartridge(cid)
    return [(text, meta.get("finish_reason") == "stop") for text, meta in zip(out.completions, out.metadata)]


def build_traces(config: Any, data: str | Path, out: str | Path, *, skip: int = 0, count: int | None = None,
                 progress: bool = True, student: tuple[Any, str] | None = None, student_tokens: int = 256) -> dict:
    """GSM8K problems [skip, skip + count) -> tool-use rows appended to `out` (a file already there is refused:
    its rows would be mixed with another run's). Every problem's call must have run. student: (an InferenceEngine,
    a cartridge file): rows from its own first turns instead (student_turns), each at most `student_tokens`."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    out = Path(out)
    if out.exists():
        raise ConfigError("exists; traces are written to a new file", key="--out", path=str(out))
    if skip < 0 or (count is not None and count < 1) or student_tokens < 1:
        key = "--skip" if skip < 0 else "--student-tokens" if student_tokens < 1 else "--count"
        raise ConfigError("--skip must be >= 0, --count and --student-tokens >= 1", key=key)
    problems = first_of_each_question(load_problems(data, None if count is None else skip + count)[skip:],
                                      lambda problem: problem.question)  # a repeat would weigh twice
    if not problems:
        raise ConfigError(f"no problems after skipping {skip}", key="--skip", path=str(data))
    local = resolve_model_path(config.model_path)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or local)
    builder = TraceBuilder(config, tokenizer, eos_token_ids(local, tokenizer)[0])
    own = student_answers(student, builder, problems, student_tokens, progress) if student else None
    rows = []
    for i, problem in enumerate(tqdm(problems, desc="traces", unit="problem", disable=not progress)):
        trace, calls = builder.play_student(problem, *own[i]) if own else builder.play(problem)
        if not calls or calls[0].get("reward") is None or calls[0].get("error"):
            raise ConfigError(f"problem {problem.index}: the reference call did not run: {calls}", key="--tools")
        base = 100 * problem.index + (STUDENT_ROW_IDS if own else 0)
        rows += [conversation(r, base + k, problem) for k, r in enumerate(trace)]
    append(out, rows)
    targets = sum(sum(r.mask) if r.mask else len(r.answer_ids) for r in rows)
    return {"out": str(out), "problems": len(problems), "rows": len(rows), "targets": targets,
            "tokens": sum(len(r.ids) for r in rows)}

