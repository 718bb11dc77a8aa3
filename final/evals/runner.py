"""The loop every evaluation runs: rows in batches through a generator, each sample scored as veRL's
NaiveRewardManager scores it, one JSON line per sample, resumable.

Every batch is prepared (validated, tokenized) before the first one runs, so a bad row is a typed error before any
generation. Samples are written as their batch finishes; with `resume`, the samples of rows already in the output
file are read back (a torn last line is dropped) and those rows are not run again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from final.errors import ConfigError, PromptError
from final.evals.verl_data import Row, prompt_error_row
from final.sampling import CONSTRAINT_KEYS

if TYPE_CHECKING:
    from final.evals.verl_reward import Scorer
    from final.outputs import GenerationOutput


class Generator(Protocol):
    def prepare(self, prompts: list, tools_kwargs: list[dict] | None) -> Any: ...

    def run(self, prepared: Any) -> "GenerationOutput": ...


@dataclass
class EngineGenerator:
    """An InferenceEngine (or a ReplicaPool: the same API) with the evaluation's sampling and cartridges."""

    engine: Any
    sampling: dict
    cartridge: Any = None
    progress: bool = False  # the engine's bar over each call's samples (the eval's own counts whole batches)

    def prepare(self, prompts: list, tools_kwargs: list[dict] | None) -> Any:
        return self.engine.prepare(prompts, tools_kwargs=tools_kwargs, cartridge=self.cartridge,
                                   progress=self.progress, **self.sampling)

    def run(self, prepared: Any) -> "GenerationOutput":
        return self.engine.run(prepared)


def add_constraint_flag(parser: Any) -> None:
    """`--constraint KEY=FILE`: every answer constrained by a grammar (the local backend's constraint keys)."""
    parser.add_argument("--constraint", default=None, metavar="KEY=FILE",
                        help=f"constrain every answer: {', '.join(k + '=FILE' for k in CONSTRAINT_KEYS)} (a JSON "
                             "schema, a regex, an EBNF grammar or a structural tag; the local backend serves them)")


def constraint_of(value: str | None) -> dict[str, str]:
    """--constraint KEY=FILE -> generate()'s keyword {KEY: the file's text} (a regex file's final newlines are not
    part of the pattern). ConfigError naming the flag."""
    if value is None:
        return {}
    key, sep, path = value.partition("=")
    if not sep or key not in CONSTRAINT_KEYS or not path:
        raise ConfigError(f"must be KEY=FILE with KEY one of {', '.join(CONSTRAINT_KEYS)}, got {value!r}",
                          key="--constraint")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", key="--constraint") from None
    return {key: text.rstrip("\n") if key == "regex" else text}


@dataclass
class CallableGenerator:
    """A generate(prompts, tools_kwargs) -> GenerationOutput function (nothing to prepare)."""

    generate: Callable[[list, "list[dict] | None"], "GenerationOutput"]

    def prepare(self, prompts: list, tools_kwargs: list[dict] | None) -> Any:
        return prompts, tools_kwargs

    def run(self, prepared: Any) -> "GenerationOutput":
        return self.generate(*prepared)


@dataclass
class Run:
    records: list[dict]  # every sample of the rows (resumed ones included), by (row, sample)
    seconds: float = 0.0  # generation time of this run
    resumed: int = 0  # rows read back from the output file
    tokens: int = 0  # tokens the model wrote in this run


def run_rows(rows: list[Row], generator: Generator, scorer: "Scorer", tokenizer: Any, *, multi_turn: bool,
             batch_size: int = 64, out_path: str | Path | None = None, resume: bool = False, progress: bool = False,
             extend: Callable[[dict, Row, dict], None] | None = None, prompt_key: str = "prompt",
             n: int | None = None) -> Run:
    """Generate, score and record every row (see the module doc). `extend(record, row, meta)` adds a preset's
    own fields to each record; `n` (samples per row), when known, is checked against a resumed file's."""
    if batch_size < 1:
        raise ConfigError(f"must be >= 1, got {batch_size}", key="--batch-size")
    done = read_done(out_path, rows, n) if resume and out_path else {}
    todo = [r for r in rows if r.row not in done]
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    prepared = []
    for batch in batches:  # every check before any generation
        try:
            prepared.append(generator.prepare([prompt_of(r, multi_turn) for r in batch],
                                              [r.tools_kwargs for r in batch] if multi_turn else None))
        except PromptError as exc:
            raise prompt_error_row(exc, batch, prompt_key) from None
    records = [rec for recs in done.values() for rec in recs]
    run = Run(records, resumed=len(done))
    out = _open(out_path, append=bool(done))
    bar = _bar(len(rows), len(done), progress and len(batches) > 1)
    try:
        for batch, request in zip(batches, prepared):
            t0 = time.perf_counter()
            result = generator.run(request)
            run.seconds += time.perf_counter() - t0
            n = len(result.completions) // len(batch)
            for i, (text, meta) in enumerate(zip(result.completions, result.metadata, strict=True)):
                record = sample_record(batch[i // n], i % n, text, meta, scorer, tokenizer)
                if extend:
                    extend(record, batch[i // n], meta)
                run.records.append(record)
                run.tokens += meta.get("completion_tokens") or 0
                if out:
                    out.write(json.dumps(record, ensure_ascii=False, default=_json_default) + "\n")
            if out:
                out.flush()
            bar.update(len(batch))
    finally:
        bar.close()
        if out:
            out.close()
    run.records.sort(key=lambda r: (r["row"], r["sample"]))
    return run


def prompt_of(row: Row, multi_turn: bool) -> list:
    """What generate() gets: RLHFDataset's token ids on the batch path; the messages where veRL's multi-turn path
    renders them itself (with the tools), or where no ids were rendered."""
    return row.messages if multi_turn or row.prompt_ids is None else row.prompt_ids


def sample_record(row: Row, sample: int, text: str, meta: dict, scorer: "Scorer", tokenizer: Any) -> dict:
    """One sample, scored as NaiveRewardManager scores it (module doc of final.evals.verl_reward)."""
    response = meta.get("response_text")
    if response is None:  # the batch path: the response tokens, special tokens skipped (no tokenizer: the text)
        response = text if tokenizer is None else tokenizer.decode(meta["response_ids"], skip_special_tokens=True)
    # veRL's sync rollout sets no __num_turns__ (None); rollout_reward_scores are the tools' calc_reward results
    extra_info = {**row.extra_info, "num_turns": None, "rollout_reward_scores": dict(meta.get("rewards") or {})}
    score, reward_extra = scorer(row.data_source, response, row.ground_truth, extra_info)
    calls = [c for c in meta.get("tool_calls", []) if "turn" in c]
    return {
        "row": row.row, "sample": sample, "uid": str(row.row), "data_source": row.data_source,
        "index": row.extra_info.get("index"), "ability": row.ability, **row.fields,
        "ground_truth": row.ground_truth, "response": response, "final_text": text,
        "score": score, "reward_extra_info": reward_extra,
        "tool_rewards": dict(meta.get("rewards") or {}), "num_turns": meta.get("num_turns", 1), "tool_calls": calls,
        "finish_reason": meta.get("finish_reason"), "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": meta.get("completion_tokens"),
        "messages": meta.get("messages", [*row.messages, {"role": "assistant", "content": text}]),
    }


def read_done(path: str | Path, rows: list[Row], n: int | None = None) -> dict[int, list[dict]]:
    """The samples an earlier run wrote, by row (a torn last line is cut off the file). A record that does not
    match this run's rows (another data file, another data source) is a ConfigError: resume needs the same run."""
    path = Path(path)
    if not path.is_file():
        return {}
    by_row = {r.row: r for r in rows}
    done: dict[int, list[dict]] = {}
    good_bytes = 0
    with path.open("rb") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                break  # a line the interrupted run did not finish: it and anything after it are dropped
            row = by_row.get(record.get("row"))
            if row is None or record.get("data_source") != row.data_source:
                raise ConfigError(f"holds a sample (row {record.get('row')}) that is not from this data; give "
                                  "another --out or --no-resume", key="--out", path=str(path))
            done.setdefault(row.row, []).append(record)
            good_bytes += len(line)
    with path.open("r+b") as fh:
        fh.truncate(good_bytes)
    counts = {len(v) for v in done.values()}
    if len(counts) > 1 or (n is not None and counts and counts != {n}):
        raise ConfigError(f"holds {sorted(counts)} samples a row, this run makes {n}; give another --out or "
                          "--no-resume", key="--out", path=str(path))
    return done


def _open(path: str | Path | None, append: bool) -> Any:
    if not path:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return Path(path).open("a" if append else "w")


def _bar(total: int, done: int, progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="eval", unit="row", disable=not progress)


def _json_default(value: Any) -> Any:
    """numpy scalars and arrays (a reward function's extra info) as JSON numbers and lists; anything else as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
