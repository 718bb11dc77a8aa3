"""The GSM8K task's data and prompts, shared by `final eval gsm8k` (final/evals) and the tool-use traces of
`final cartridge traces` (final/distill): one place for the problem file's format and the messages a problem becomes.

Prompts follow veRL's own preprocessing (examples/data_preprocess/gsm8k.py, gsm8k_multiturn_w_tool.py): the
question plus "Let's think step by step and output the final answer after "####"."; with tools, veRL's system
prompt asking the model to check its answer with `calc_gsm8k_reward`. A chat template that ignores `tools`
(SmolLM2's) would hide the tool from the model, so then the tool description is written into the system message in
the hermes format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from final.chat_template import FALLBACK_TOOLS, template_renders_tools as renders_tools
from final.errors import ConfigError, PromptError

DATA_SOURCE = "openai/gsm8k"
TOOL_NAME = "calc_gsm8k_reward"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
               "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after step "
               "by step solving the question, before generate final answer at least once and refine your answer if "
               "necessary. Put your final answer in the format of `#### <answer>`.")
HERMES_TOOLS = FALLBACK_TOOLS  # the fallback prompt's text lives in final.chat_template

@dataclass
class Problem:
    index: int
    question: str
    answer: str
    ground_truth: str


def load_problems(path: str | Path, limit: int | None = None) -> list[Problem]:
    """GSM8K JSONL ({"question", "answer"} per line); the ground truth is the number after '####' (veRL's
    extract_solution in examples/data_preprocess/gsm8k.py)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("GSM8K data file not found", key="--data", path=str(path))
    if limit is not None and limit < 1:
        raise ConfigError(f"must be >= 1, got {limit}", key="--limit")
    problems = []
    with path.open() as fh:
        for lineno, line in enumerate(fh):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = row["question"], row["answer"]
                match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
                if not isinstance(question, str) or match is None:
                    raise ValueError("needs a string 'question' and an 'answer' ending in '#### <number>'")
            except (ValueError, KeyError, TypeError) as exc:
                raise PromptError(f"{path} line {lineno + 1}: {exc}", index=lineno) from exc
            problems.append(Problem(lineno, question, answer, match.group(1).replace(",", "")))
    if not problems:
        raise ConfigError("no problems in the data file", key="--data", path=str(path))
    return problems


def build_messages(problem: Problem, tool_schemas: Sequence[dict] | None, template_renders_tools: bool) -> list[dict]:
    if not tool_schemas:
        return [{"role": "user", "content": f"{problem.question} {INSTRUCTION}"}]
    system = TOOL_SYSTEM
    if not template_renders_tools:
        system += HERMES_TOOLS.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in tool_schemas))
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"{problem.question} {TOOL_INSTRUCTION}"}]


def template_renders_tools(tokenizer: Any, tool_schemas: Sequence[dict] = ()) -> bool:
    """Whether the chat template puts `tools` in the prompt (final.chat_template's probe)."""
    return renders_tools(tokenizer)
