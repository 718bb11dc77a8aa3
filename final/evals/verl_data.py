"""veRL's RL-dataset parquet, read and rendered as veRL's RLHFDataset (verl/utils/dataset/rl_dataset.py) does.

Each row (examples/data_preprocess/*.py write them): `data_source`, the prompt column (`data.prompt_key`, chat
messages), `ability`, `reward_model.ground_truth`, `extra_info` (index, tools_kwargs, need_tools_kwargs,
interaction_kwargs, anything else the reward function reads). Every row is checked before any generation; a bad one
is a DataError naming the file, row and column.

Rendering is RLHFDataset's: `apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
**apply_chat_template_kwargs)` encoded without special tokens (its raw_prompt_ids, what veRL's rollout sends), cut
to `max_prompt_length` by `truncation` (left / right / middle; `error` refuses the row), after
`filter_overlong_prompts` dropped rows whose tokenized chat is longer. (veRL 0.6.0's; 0.9's dataset hands the
messages to its agent loop, which renders them the same way and cuts nothing.) Parquet gives a struct column the
union of every row's keys, so a key one row lacks reads None: None-valued message keys are dropped, and a
tools_kwargs entry that is None names no tool (veRL would crash on either).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from final.compat import chat_ids
from final.errors import ConfigError, DataError, PromptError

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Row:
    """One dataset row, checked; `prompt_ids` is set by render()."""

    row: int  # position in the data (all files, in order): the prompt's uid
    path: str
    file_row: int
    data_source: str
    messages: list[dict]
    ground_truth: Any
    extra_info: dict
    tools_kwargs: dict  # tool name -> {create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs}
    ability: Any = None
    need_tools_kwargs: bool = False
    prompt_ids: list[int] | None = None
    fields: dict = field(default_factory=dict)  # extra columns of the record (the gsm8k preset's question, ...)

    def error(self, message: str, column: str | None = None) -> DataError:
        return DataError(message, path=self.path, row=self.file_row, column=column)


def read_parquet(path: str | Path, key: str = "--data") -> list[dict]:
    """A parquet file's rows as dicts (pyarrow, as `datasets` reads them for RLHFDataset)."""
    import pyarrow.parquet as pq

    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError("data file not found", key=key, path=str(path))
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a file that is not parquet
        raise DataError(f"cannot read it as parquet: {exc}", path=str(path)) from None


def load_rows(files: Sequence[str], prompt_key: str = "prompt", reward_fn_key: str = "data_source",
              limit: int | None = None, need_tools_kwargs: bool = False) -> list[Row]:
    """The rows of every file, in order (the first `limit` in all), each checked (DataError)."""
    if limit is not None and limit < 1:
        raise ConfigError(f"must be >= 1, got {limit}", key="--limit")
    rows: list[Row] = []
    for path in files:
        table = read_parquet(path)
        if table:
            missing = [c for c in (prompt_key, reward_fn_key, "reward_model") if c not in table[0]]
            if missing:
                raise DataError(f"missing (the file has {', '.join(sorted(table[0]))})", path=str(path),
                                column=missing[0])
        for i, raw in enumerate(table):
            if limit is not None and len(rows) >= limit:
                return rows
            rows.append(check_row(raw, len(rows), str(path), i, prompt_key, reward_fn_key, need_tools_kwargs))
    if not rows:
        raise DataError("no rows", path=str(files[0]) if files else None)
    return rows


def check_row(raw: dict, row: int, path: str, file_row: int, prompt_key: str, reward_fn_key: str,
              need_tools_kwargs: bool = False) -> Row:
    """One parquet row -> Row; DataError names what is wrong."""
    def bad(message: str, column: str) -> DataError:
        return DataError(message, path=path, row=file_row, column=column)

    source = raw.get(reward_fn_key)
    if not isinstance(source, str) or not source:
        raise bad(f"must be a data source name (a string), got {source!r}", reward_fn_key)
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise bad("needs a ground_truth (veRL's reward manager reads reward_model['ground_truth'])",
                  "reward_model.ground_truth")
    extra = raw.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise bad(f"must be a mapping, got {type(extra).__name__}", "extra_info")
    tools_kwargs = extra.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, dict) or not all(isinstance(v, dict) or v is None for v in tools_kwargs.values()):
        raise bad("must map each tool name to its {create_kwargs, execute_kwargs, ...}", "extra_info.tools_kwargs")
    need = extra.get("need_tools_kwargs")
    return Row(row, path, file_row, source, messages_of(raw.get(prompt_key), bad, prompt_key),
               reward_model["ground_truth"], dict(extra), {k: v for k, v in tools_kwargs.items() if v is not None},
               raw.get("ability"), need_tools_kwargs if need is None else bool(need))


def messages_of(value: Any, bad: Any, column: str) -> list[dict]:
    """The prompt column: a non-empty list of {role, content} messages (None-valued keys dropped)."""
    if not isinstance(value, list) or not value:
        raise bad(f"must be a non-empty list of chat messages, got {type(value).__name__}", column)
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"message {j} must be a mapping with role and content", column)
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") not in ROLES:
            raise bad(f"message {j} has role {message.get('role')!r}; expected one of {', '.join(ROLES)}", column)
        if not isinstance(message.get("content"), str) and not message.get("tool_calls"):
            raise bad(f"message {j} needs a string content", column)
        messages.append(message)
    return messages


def render(rows: list[Row], tokenizer: Any, max_prompt_length: int, truncation: str = "error",
           filter_overlong: bool = False, chat_kwargs: dict | None = None, prompt_key: str = "prompt"
           ) -> tuple[list[Row], list[Row]]:
    """Each row's prompt ids as RLHFDataset computes them -> (kept rows, rows filter_overlong_prompts dropped)."""
    kwargs = dict(chat_kwargs or {})
    if kwargs.get("chat_template") is None and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("the tokenizer has no chat template; set data.apply_chat_template_kwargs.chat_template",
                          key="data.apply_chat_template_kwargs")
    kept, dropped = [], []
    for r in rows:
        try:
            if filter_overlong and len(chat_ids(tokenizer, r.messages, add_generation_prompt=True,
                                                **kwargs)) > max_prompt_length:
                dropped.append(r)
                continue
            text = tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render this row's messages
            raise r.error(f"the chat template cannot render it: {exc}", prompt_key) from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_prompt_length:
            ids = truncate(ids, max_prompt_length, truncation, r, prompt_key)
        r.prompt_ids = ids
        kept.append(r)
    return kept, dropped


def truncate(ids: list[int], limit: int, side: str, row: Row, column: str) -> list[int]:
    """RLHFDataset's cut of raw_prompt_ids to max_prompt_length."""
    if side == "left":
        return ids[-limit:]
    if side == "right":
        return ids[:limit]
    if side == "middle":
        left = limit // 2
        return ids[:left] + ids[-(limit - left):]
    raise row.error(f"has {len(ids)} tokens, over data.max_prompt_length={limit} (data.truncation=error; set "
                    "data.filter_overlong_prompts=true to skip such rows, or a truncation side)", column)


def check_tools(rows: list[Row], tool_names: list[str] | None, tool_config: str | None) -> list[Row]:
    """Every tool a row's tools_kwargs names must be in the tool config (veRL would KeyError mid-rollout).
    Returns the rows that name tools while no tool config is on (they run single-turn, as veRL runs them)."""
    if tool_names is None:
        return [r for r in rows if r.tools_kwargs]
    for r in rows:
        for name in r.tools_kwargs:
            if name not in tool_names:
                raise r.error(f"names tool {name!r}, which the tool config {tool_config} lacks (it has: "
                              f"{', '.join(tool_names) or 'none'})", f"extra_info.tools_kwargs.{name}")
    return []


def prompt_error_row(exc: PromptError, batch: list[Row], column: str) -> DataError:
    """A PromptError of a batch's preparation (its index is the batch's) as the row's DataError."""
    index = exc.index if exc.index is not None and 0 <= exc.index < len(batch) else None
    message = str(exc).split(": ", 1)[1] if index is not None and ": " in str(exc) else str(exc)
    return batch[index].error(message, column) if index is not None else DataError(message)


# ---- writing: veRL's GSM8K-with-tool layout, for users whose GSM8K is the JSONL (no HF hub) ------------------------
VERL_GSM8K_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                     "Reasoning step by step before any tool call. "
                     "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
                     "before generate final answer at least once and refine your answer if necessary. "
                     "Put your final answer in the format of `#### <answer>`.")


def gsm8k_multiturn_w_tool(problems: Sequence[dict], split: str = "test") -> list[dict]:
    """GSM8K problems ({question, answer}) as the rows veRL's examples/data_preprocess/gsm8k_multiturn_w_tool.py
    writes (its process_fn, verbatim in effect): the system prompt above, the question + the instruction, the
    `#### N` answer as ground truth, calc_gsm8k_reward's create_kwargs."""
    import re

    rows = []
    for idx, example in enumerate(problems):
        answer_raw = example["answer"]
        solution = re.search("#### (\\-?[0-9\\.\\,]+)", answer_raw).group(0).split("#### ")[1].replace(",", "")
        question = example["question"] + " " + "Let's think step by step and output the final answer after `####`."
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": VERL_GSM8K_SYSTEM}, {"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": example["question"],
                           "need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
                           "interaction_kwargs": {"query": question, "ground_truth": solution}}})
    return rows


def write_parquet(path: str | Path, rows: list[dict]) -> Path:
    """Rows as a parquet file, written as veRL's preprocessing writes them (`datasets`' to_parquet)."""
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return Path(path)
