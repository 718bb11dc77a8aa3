"""`final bench --only multiturn`: conversations shaped like a tool loop, and n samples of one long prompt.

Each conversation: a system prompt listing tool schemas (JSON), then `turns` turns of ~`new` tokens (a tool result
or a user message, as the chat template renders it, with the assistant header) and `generated` greedy tokens (fixed
length, no early stop), every turn appended to the history as ids: a tool loop's history grows to ~2k tokens.
`batch` conversations run side by side (their turns submitted together). Each peer continues its own
conversations with its own answers (same weights: they agree, and the work is the same either way):

- ours, the embedded engine with its prefix cache (on by default): turn k prefills only what turn k added;
- ours without it (`prefix_cache: false`): every turn prefills the whole history;
- HF `generate` (left-padded batch, DynamicCache within a call, nothing kept between calls);
- llama.cpp (llama-cpp-python, the `bench` extra; skipped with a note when absent) on the same F32 weights,
  each conversation a sequence of one context kept between turns (its server's slots): like our cache it
  evaluates only the new tokens of a turn.

Figures per peer: time to first token of each turn (submission to the first new token; a batch's rows averaged)
and the whole conversation's wall time, medians over repeats run alternately in one process; the time after first
tokens (the wall less every turn's TTFT: the decode steps), and from it `cache_floor`, the cached run's ratio if
turns 2.. prefilled in no time (decode and turn 1 are what a prefix cache cannot remove). The n-samples part:
one ~1k-token prompt, n = 8 samples, with and without the cache (each run after a flush): its wall time and
cached_tokens (the prefill done once: the other n-1 samples report their whole prompt as cached).
"""

from __future__ import annotations

import abc
import json
import random
import statistics
import time
from typing import Any, Callable

import torch

from final.bench.peer import INSTALL, LlamaCpp, llama_cpp_weights
from final.bench.timing import on_own_thread
from final.engine import EmbeddedEngine

TOOLS = [("get_weather", "Current weather for a city", {"city": "string", "unit": "string"}),
         ("search_web", "Search the web and return the top results", {"query": "string", "limit": "integer"}),
         ("calculator", "Evaluate an arithmetic expression exactly", {"expression": "string"}),
         ("read_file", "Read a text file from the workspace", {"path": "string", "max_bytes": "integer"}),
         ("run_python", "Run a Python snippet in a sandbox and return stdout", {"code": "string"}),
         ("send_email", "Send an email to one recipient", {"to": "string", "subject": "string", "body": "string"})]


def system_ids(tokenizer: Any) -> list[int]:
    schemas = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
        "type": "object", "properties": {k: {"type": t, "description": f"the {k}"} for k, t in p.items()},
        "required": list(p)}}} for n, d, p in TOOLS]
    text = ("<|im_start|>system\nYou are a helpful assistant. You may call one or more tools to assist with the "
            "user query. Tool signatures:\n<tools>\n" + "\n".join(json.dumps(s) for s in schemas) +
            "\n</tools>\nFor each call return a JSON object in <tool_call></tool_call> tags.<|im_end|>\n")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_ids(tokenizer: Any, rng: random.Random, tokens: int) -> list[int]:
    """A tool result of exactly `tokens` tokens of content, then the assistant header."""
    rows = [{"id": rng.randrange(10**6), "title": f"result {i} for item {rng.randrange(999)}",
             "score": round(rng.random(), 3), "snippet": " ".join(rng.choice(WORDS) for _ in range(8))}
            for i in range(12)]
    head = tokenizer("<|im_start|>user\n<tool_response>\n", add_special_tokens=False)["input_ids"]
    body = tokenizer(json.dumps(rows), add_special_tokens=False)["input_ids"][: max(tokens - len(head), 1)]
    tail = tokenizer("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    return head + body + tail


WORDS = ("the data shows revenue growth in the northern region while costs fell slightly over the last quarter "
         "and the team expects further gains next year").split()


def conversations(tokenizer: Any, batch: int, turns: int, new: int, seed: int = 0) -> list[list[list[int]]]:
    """[conversation][turn] -> the ids that turn adds before its answer (the first turn after the system prompt)."""
    rng, system = random.Random(seed), system_ids(tokenizer)
    out = []
    for _ in range(batch):
        adds = [turn_ids(tokenizer, rng, new) for _ in range(turns)]
        adds[0] = system + adds[0]
        out.append(adds)
    return out


class Peer(abc.ABC):
    """One side of the table."""

    name = ""

    @abc.abstractmethod
    def turn(self, histories: list[list[int]], generated: int) -> tuple[list[list[int]], list[float]]:
        """Every conversation's next turn (histories end with the turn's new ids): (answers, seconds to each
        row's first new token)."""

    def reset(self) -> None:
        """Forget the previous conversations (a fresh run)."""

    def close(self) -> None:
        """Release the peer's engine."""


class Ours(Peer):
    def __init__(self, model_dir: str, cache: bool, max_len: int, rows: int):
        self.name = "ours, prefix cache" if cache else "ours, no cache"
        self.engine = EmbeddedEngine(model_dir, dtype="float32", prefix_cache=cache, max_model_len=max_len,
                                     max_running_requests=rows)

    def turn(self, histories: list[list[int]], generated: int) -> tuple[list[list[int]], list[float]]:
        params = {"max_new_tokens": generated, "temperature": 0, "ignore_eos": True}
        seqs = self.engine.sequences(histories, params)
        first: dict[int, float] = {}
        for i, seq in enumerate(seqs):  # the engine thread calls it after each token but the last
            seq.on_token = lambda _s, i=i: first.setdefault(i, time.perf_counter())
        t0 = time.perf_counter()
        outs = self.engine.submit(seqs).result()
        return [o["output_ids"] for o in outs], [first.get(i, time.perf_counter()) - t0 for i in range(len(seqs))]

    def cached(self) -> int:
        return self.engine.stats.cached_tokens

    def reset(self) -> None:
        self.engine.flush_cache()

    def close(self) -> None:
        self.engine.shutdown()


class HFGenerate(Peer):
    name = "HF generate"

    def __init__(self, model_dir: str, pad_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.pad_id = pad_id

    def turn(self, histories: list[list[int]], generated: int) -> tuple[list[list[int]], list[float]]:
        width = max(map(len, histories))
        ids = torch.tensor([[self.pad_id] * (width - len(h)) + h for h in histories])
        mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in histories])
        marks: list[float] = []

        class Streamer:  # generate's streamer: put(prompt), then put(new tokens) once a step
            def put(self, _value: Any) -> None:
                marks.append(time.perf_counter())

            def end(self) -> None:
                pass

        def run() -> list[list[int]]:
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=generated, do_sample=False,
                                          pad_token_id=self.pad_id, use_cache=True, streamer=Streamer())
            return out[:, width:].tolist()

        t0 = time.perf_counter()
        answers = on_own_thread(run)  # its OpenMP team ends with the thread (bench/timing.py)
        return answers, [marks[1] - t0] * len(histories)


class LlamaCppSlots(Peer):
    """llama.cpp with each conversation's tokens kept in its context between turns (a sequence id each)."""

    name = "llama.cpp"

    def __init__(self, weights: Any, threads: int, rows: int, max_len: int, on: Callable[[Callable], Any]):
        self.on = on  # runs a function on the thread that runs everything (the engine's, as the peer section)
        self.peer = on(lambda: LlamaCpp(weights, threads, rows, max_len))
        self.kept: list[list[int]] = [[] for _ in range(rows)]

    def turn(self, histories: list[list[int]], generated: int) -> tuple[list[list[int]], list[float]]:
        t0 = time.perf_counter()
        news = [h[len(k):] for h, k in zip(histories, self.kept)]
        answers, first = self.on(lambda: self.peer.extend(news, [len(k) for k in self.kept], generated))
        for i, (h, a) in enumerate(zip(histories, answers)):
            self.kept[i] = h + a[:-1]  # the newest token is not evaluated yet
        return answers, [first - t0] * len(histories)

    def reset(self) -> None:
        self.on(self.peer.clear)
        self.kept = [[] for _ in self.kept]

    def close(self) -> None:
        self.on(self.peer.close)


def play(peer: Peer, convs: list[list[list[int]]], generated: int, tail: list[int]) -> dict:
    """All conversations turn by turn: per-turn mean TTFT, the wall time, the last answers."""
    peer.reset()
    histories = [[] for _ in convs]
    ttfts, t0 = [], time.perf_counter()
    for k in range(len(convs[0])):
        histories = [h + c[k] for h, c in zip(histories, convs)]
        answers, firsts = peer.turn(histories, generated)
        ttfts.append(statistics.mean(firsts))
        histories = [h + a + tail for h, a in zip(histories, answers)]
    return {"ttft": ttfts, "wall": time.perf_counter() - t0, "history_tokens": max(map(len, histories))}


def run_multiturn(model_name: str, model_dir: str, batches: list[int], turns: int, new: int, generated: int,
                  repeats: int, samples: int = 8, sample_prompt: int = 1024) -> dict:
    """The multiturn section: each batch size's table, and the n-samples row."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tail = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    weights, why_not = llama_cpp_weights(model_name)
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"turns": turns, "new_tokens": new, "generated": generated, "threads": threads,
                           "llama_cpp": "same F32 weights" if weights else f"skipped: {why_not} ({INSTALL})",
                           "batches": []}
    for batch in batches:
        convs = conversations(tokenizer, batch, turns, new)
        max_len = len(convs[0][0]) + turns * (new + generated + len(tail)) + 64
        peers: list[Peer] = [Ours(model_dir, True, max_len, batch), Ours(model_dir, False, max_len, batch),
                             HFGenerate(model_dir, pad)]
        if weights:
            engine = peers[0].engine
            peers.append(LlamaCppSlots(weights, threads, batch, max_len, lambda fn: engine.call(lambda _r: fn())))
        try:
            out["batches"].append(_measure(peers, convs, generated, tail, repeats, batch))
        finally:
            for peer in reversed(peers):  # llama.cpp runs on the first engine's thread: it goes first
                peer.close()
    out["samples"] = run_samples(model_dir, tokenizer, samples, sample_prompt, generated, repeats)
    return {"multiturn": out}


def _measure(peers: list[Peer], convs: list, generated: int, tail: list[int], repeats: int, batch: int) -> dict:
    runs: dict[str, list[dict]] = {p.name: [] for p in peers}
    cached = {}
    for i in range(repeats + 1):  # the first round warms every peer up and is not counted
        for peer in (peers if i % 2 == 0 else peers[::-1]):
            before = peer.cached() if isinstance(peer, Ours) else 0
            result = play(peer, convs, generated, tail)
            if isinstance(peer, Ours):
                cached[peer.name] = peer.cached() - before
            if i:
                runs[peer.name].append(result)
    rows = {}
    for name, results in runs.items():
        ttft = [statistics.median(r["ttft"][k] for r in results) for k in range(len(convs[0]))]
        rows[name] = {"wall_s": round(statistics.median(r["wall"] for r in results), 3),
                      "ttft_ms": [round(t * 1e3, 1) for t in ttft],
                      "turn_last_over_first": round(ttft[-1] / ttft[0], 2),
                      # what follows each turn's first token: the decode steps, at the memory's rate on a CPU
                      "after_first_s": round(statistics.median(r["wall"] - sum(r["ttft"]) for r in results), 3)}
        if name in cached:
            rows[name]["cached_tokens"] = cached[name]
    mine, off = rows["ours, prefix cache"], rows["ours, no cache"]
    ratios = {"cache_over_no_cache": round(mine["wall_s"] / off["wall_s"], 3),
              # the least the cache could reach: the cached run if turns 2.. prefilled their new tokens in no time
              "cache_floor": round((mine["after_first_s"] + mine["ttft_ms"][0] / 1e3) / off["wall_s"], 3),
              "hf_over_ours": round(rows["HF generate"]["wall_s"] / mine["wall_s"], 2)}
    if "llama.cpp" in rows:
        ratios["llama_cpp_over_ours"] = round(rows["llama.cpp"]["wall_s"] / mine["wall_s"], 2)
    return {"batch": batch, "history_tokens": runs[peers[0].name][0]["history_tokens"], "rows": rows,
            "ratios": ratios}


def run_samples(model_dir: str, tokenizer: Any, n: int, length: int, generated: int, repeats: int) -> dict:
    """n samples of one `length`-token prompt, with and without the cache (flushed before each run)."""
    rng = random.Random(1)
    prompt = (system_ids(tokenizer) + turn_ids(tokenizer, rng, length))[:length]
    params = {"max_new_tokens": generated, "temperature": 0.8, "seed": 1, "n": n, "ignore_eos": True}
    engines = {True: EmbeddedEngine(model_dir, max_running_requests=n), False: EmbeddedEngine(
        model_dir, prefix_cache=False, max_running_requests=n)}
    times: dict[bool, list[float]] = {True: [], False: []}
    cached: dict[bool, list[int]] = {}
    try:
        for i in range(repeats + 1):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                engines[on].flush_cache()
                t0 = time.perf_counter()
                outs = engines[on].generate(prompt, params)
                if i:
                    times[on].append(time.perf_counter() - t0)
                cached[on] = [o["meta_info"]["cached_tokens"] for o in outs]
    finally:
        for engine in engines.values():
            engine.shutdown()
    on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
    return {"n": n, "prompt_tokens": len(prompt), "generated": generated, "cache_s": round(on_s, 3),
            "no_cache_s": round(off_s, 3), "ratio": round(on_s / off_s, 3), "cached_tokens": cached[True],
            "cached_tokens_without": cached[False]}


def describe(res: dict) -> list[str]:
    """The multiturn section's lines for `final bench`'s table."""
    lines = [f"  {res['turns']} turns of {res['new_tokens']} new + {res['generated']} generated tokens, greedy, "
             f"{res['threads']} threads; llama.cpp: {res['llama_cpp']}"]
    for b in res["batches"]:
        lines.append(f"  batch {b['batch']} (history up to {b['history_tokens']} tokens): " +
                     ", ".join(f"{k} {v}x" for k, v in b["ratios"].items()))
        for name, r in b["rows"].items():
            extra = f", cached {r['cached_tokens']} tokens" if "cached_tokens" in r else ""
            lines.append(f"    {name:20} {r['wall_s']:8.2f} s ({r['after_first_s']:.2f} s after first tokens); "
                         f"TTFT ms by turn {r['ttft_ms']} (last/first {r['turn_last_over_first']}x){extra}")
    s = res["samples"]
    lines.append(f"  n = {s['n']} samples of a {s['prompt_tokens']}-token prompt, {s['generated']} tokens each: "
                 f"{s['cache_s']:.2f} s with the cache, {s['no_cache_s']:.2f} s without ({s['ratio']}x); "
                 f"cached_tokens {s['cached_tokens']}")
    return lines

