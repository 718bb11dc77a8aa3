"""Results: one record per row, made once from what the engine (or the remote server) reported.

Every backend reports, per row, the SGLang `meta_info` of its last engine call: finish reason (and the stop token
or string that matched), prompt / cached / completion tokens, and the chosen tokens' logprobs. When a call's
meta_info sets ROW_INFO, the backend puts that record in the output DataProto's non_tensor_batch[ROW_INFO], so
the Python API and the HTTP server read the same facts and nothing re-derives them from masks.

Asked for in meta_info (PROMPT_LOGPROBS, TOP_LOGPROBS), a record also carries every prompt token's logprob and the
k most likely tokens at each position: what scoring (InferenceEngine.score, `echo` over HTTP) reads.

Token counts follow OpenAI's usage: `prompt_tokens` counts everything the completion was conditioned on, a
cartridge's tokens included, and `cached_tokens` says how many of those came from a cache (the cartridge).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from final.errors import EngineError, SequenceError

ROW_INFO = "final_row_info"  # meta_info flag and non_tensor_batch key
TRACE_KEY = "final_tool_trace"  # meta_info flag: multi-turn adds non_tensor_batch["tool_calls"] (call records)
PROMPT_LOGPROBS = "final_prompt_logprobs"  # meta_info flag: score every prompt token (SGLang's logprob_start_len=0)
TOP_LOGPROBS = "final_top_logprobs"  # meta_info: k alternatives per position (SGLang's top_logprobs_num)
SINGLE_TURN = "final_single_turn"  # meta_info flag: one assistant turn (tools offered, not run) even with tools.yaml
CALL_TOOLS = "final_call_tools"  # meta_info: {"tools": ToolSet, "format", "max_turns", "schemas"}: this call's loop
TEMPLATE_KWARGS = "final_template_kwargs"  # meta_info: chat template variables the multi-turn loop renders with
Top = list[tuple[int, float]]  # the k most likely tokens at one position: (token id, logprob), most likely first


@dataclass
class Completion:
    """One row: the engine's output ids and record. While a stream runs, finish_reason is None."""

    index: int
    output_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended the row
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    message: str | None = None  # why an aborted row stopped
    top_logprobs: list[Top] | None = None  # per output token
    prompt_logprobs: list[float | None] | None = None  # per prompt token, None for the first (nothing before it)
    prompt_top_logprobs: list[Top | None] | None = None
    weights_version: int | None = None  # the weights that made the row (InferenceEngine.weights_version)

    @classmethod
    def from_engine(cls, index: int, out: dict, prompt_logprobs: bool = False) -> "Completion":
        """From an SGLang 0.5.2 `async_generate` result dict (the engine dialect). prompt_logprobs: the call asked
        for every prompt token's logprob (logprob_start_len=0); otherwise input_token_logprobs is SGLang's default
        (the last prompt token only) and is not kept."""
        meta = out["meta_info"]
        reason = meta.get("finish_reason") or {}
        pairs = meta.get("output_token_logprobs")
        inputs = meta.get("input_token_logprobs") if prompt_logprobs else None
        return cls(index, list(out["output_ids"]), reason.get("type"), reason.get("matched"),
                   int(meta.get("prompt_tokens") or 0), int(meta.get("cached_tokens") or 0),
                   [lp for lp, _, _ in pairs] if pairs is not None else None, reason.get("message"),
                   _tops(meta.get("output_top_logprobs")), [lp for lp, _, _ in inputs] if inputs is not None else None,
                   _tops(meta.get("input_top_logprobs")) if inputs is not None else None)

    @property
    def completion_tokens(self) -> int:
        """How many tokens the row generated."""
        return len(self.output_ids)

    def info(self) -> dict[str, Any]:
        """What travels in the DataProto beside the tensors (the ids are the response tensor's first tokens)."""
        return {"finish_reason": self.finish_reason, "matched": self.matched, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
                "logprobs": self.logprobs, "message": self.message, "top_logprobs": self.top_logprobs,
                "prompt_logprobs": self.prompt_logprobs, "prompt_top_logprobs": self.prompt_top_logprobs}

    def without_output(self) -> "Completion":
        """The row of a scoring call (max_tokens=0): nothing generated. Backends may still have made a token (veRL's
        batch path needs one per row, and SGLang 0.5.2 makes one even for max_new_tokens=0); it is dropped."""
        return replace(self, output_ids=[], finish_reason="abort" if self.finish_reason == "abort" else "length",
                       matched=None, logprobs=[],
                       top_logprobs=[] if self.top_logprobs is not None else None)


def _tops(entries: list | None) -> list[Top | None] | None:
    """SGLang's top-logprob lists ([(logprob, token id, text)] per position, None where there is none) -> Top."""
    if entries is None:
        return None
    return [None if e is None else [(tok, lp) for lp, tok, _ in e] for e in entries]


def row_infos(outputs: Iterable[dict], prompt_logprobs: bool = False) -> list[dict]:
    """ROW_INFO values for engine result dicts, in row order."""
    return [Completion.from_engine(i, out, prompt_logprobs).info() for i, out in enumerate(outputs)]


def completions_of(output: Any) -> list[Completion]:
    """A batch-path DataProto that carries ROW_INFO -> one Completion per row."""
    infos = output.non_tensor_batch.get(ROW_INFO)
    if infos is None:
        raise KeyError(f"the DataProto carries no {ROW_INFO!r}: call generate_sequences with "
                       f"meta_info[{ROW_INFO!r}] = True")
    responses = output.batch["responses"]
    rows = []
    for i, info in enumerate(infos):
        ids = responses[i, :info["completion_tokens"]].tolist()
        rows.append(Completion(i, ids, info["finish_reason"], info.get("matched"), info["prompt_tokens"],
                               info["cached_tokens"], info.get("logprobs"), info.get("message"),
                               info.get("top_logprobs"), info.get("prompt_logprobs"), info.get("prompt_top_logprobs")))
    return rows


def raise_if_aborted(rows: Iterable[Completion]) -> None:
    """A row the engine aborted (its logits were not finite, sampling it failed, its step failed) has no answer:
    the call fails with SequenceError naming the row and the engine's cause. Other calls are untouched."""
    failed = next((r for r in rows if r.finish_reason == "abort"), None)
    if failed is not None:
        raise SequenceError(failed.message or "aborted", failed.index)


def completion_text(tokenizer: Any, ids: Sequence[int], *, eos_ids: Iterable[int], stop: Sequence[str] = (),
                    ignore_eos: bool = False, keep_ids: Iterable[int] = ()) -> str:
    """What the user reads: ids up to the first eos (unless ignore_eos), decoded without special tokens but
    `keep_ids` (the special tokens that mark tool calls or reasoning), cut before the first stop string (SGLang's
    and OpenAI's trimming)."""
    return cut_at_stop(raw_text(tokenizer, ids, eos_ids=eos_ids, ignore_eos=ignore_eos, keep_ids=keep_ids), stop)


def raw_text(tokenizer: Any, ids: Sequence[int], *, eos_ids: Iterable[int], ignore_eos: bool = False,
             keep_ids: Iterable[int] = ()) -> str:
    """The text of generated ids, cut before the first EOS id unless ignore_eos."""
    if not ignore_eos:
        eos = frozenset(eos_ids)
        cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        ids = ids[:cut]
    keep = frozenset(keep_ids)
    if keep and keep.intersection(ids):  # skip_special_tokens would drop the markers: drop the other specials only
        dropped = special_ids(tokenizer) - keep
        return tokenizer.decode([t for t in ids if t not in dropped], skip_special_tokens=False)
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", 0)}
    return frozenset(ids)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` cut before the earliest stop string in it, as SGLang and OpenAI cut it."""
    hits = [p for p in (text.find(s) for s in stop) if p != -1]
    return text[:min(hits)] if hits else text


@dataclass
class GenerationOutput:
    """Rows are prompt-major: with n samples per prompt, rows i*n .. i*n+n-1 belong to prompt i."""

    completions: list[str]
    token_ids: list[list[int]]
    metadata: list[dict] = field(default_factory=list)
    n: int = 1

    def grouped(self) -> list[list[str]]:
        """Completions as one list of n samples per prompt."""
        return [self.completions[i:i + self.n] for i in range(0, len(self.completions), self.n)]

    @property
    def tool_calls(self) -> list[list[dict]]:
        """Per row, the tool calls it made (a call with tools): OpenAI's shape, `{"id", "type": "function",
        "function": {"name", "arguments": JSON string}}`; its completion is the text before them."""
        return [list((m.get("message") or {}).get("tool_calls") or []) for m in self.metadata]

    @property
    def reasoning(self) -> list[str | None]:
        """Per row, the <think> reasoning split from its answer (None: none; a thinking model only)."""
        return [(m.get("message") or {}).get("reasoning_content") for m in self.metadata]

    def rows(self) -> list[Completion]:
        """Each row's record as a Completion (index = prompt * n + sample)."""
        return [Completion(i, m["response_ids"], m["finish_reason"], m.get("matched"), m["prompt_tokens"],
                           m.get("cached_tokens", 0), m.get("logprobs"), None, m.get("top_logprobs"),
                           m.get("prompt_logprobs"), m.get("prompt_top_logprobs"), m.get("weights_version"))
                for i, m in enumerate(self.metadata)]


@dataclass
class Score:
    """One row of InferenceEngine.score: the log-probs of given tokens (what lm-eval's loglikelihood asks for).

    Positions are the row's tokens, prompt then continuation. The first prompt token has no logprob: nothing comes
    before it (nor after a cartridge, which is KV, not tokens whose next-token logits exist)."""

    prompt_ids: list[int]
    continuation_ids: list[int]
    prompt_logprobs: list[float | None]
    continuation_logprobs: list[float]
    logprob: float  # sum of continuation_logprobs; without a continuation, of every prompt logprob
    is_greedy: bool  # every scored token is the most likely one at its position
    prompt_top_logprobs: list[Top | None] | None = None  # with top_logprobs=k: the k most likely per position
    continuation_top_logprobs: list[Top] | None = None
    cached_tokens: int = 0  # the cartridge tokens the scores are conditional on


def scores_of(ids: list[list[int]], starts: list[int], metadata: list[dict], top_logprobs: int) -> list[Score]:
    """Scoring rows' records -> Scores. ids: each row's tokens (prompt + continuation), starts: where each
    continuation begins; metadata carries at least one alternative per position (the greedy check needs it)."""
    scores = []
    for i, (row_ids, start, meta) in enumerate(zip(ids, starts, metadata)):
        values, tops = meta.get("prompt_logprobs"), meta.get("prompt_top_logprobs")
        if values is None or len(values) != len(row_ids) or tops is None or len(tops) != len(row_ids):
            raise EngineError(f"the engine returned no prompt logprobs (or alternatives) for every token of row {i}"
                              f"{': ' + meta['message'] if meta.get('message') else ''}")
        scored = range(start if start < len(row_ids) else 1, len(row_ids))
        greedy = all(values[j] >= tops[j][0][1] or row_ids[j] == tops[j][0][0] for j in scored)
        cut = (lambda t: [None if x is None else x[:top_logprobs] for x in t]) if top_logprobs else None  # noqa: E731
        scores.append(Score(
            list(row_ids[:start]), list(row_ids[start:]), list(values[:start]), list(values[start:]),
            float(sum(values[j] for j in scored)), greedy,
            cut(tops[:start]) if cut else None, cut(tops[start:]) if cut else None, meta.get("cached_tokens", 0)))
    return scores
