"""The CPU peer: llama.cpp beside the embedded engine, on the same weights (`final bench --only peer`).

A CPU user who wants speed picks llama.cpp, so that is the figure to stand beside. Both sides get the same weights:
the model's GGUF (what builtin:smollm2-135m-instruct is converted from, or a .gguf model path) dequantized to an
F32 GGUF with the `gguf` package, which is exactly what the engine loads (its HF folder holds the same dequantized
fp32 values). Same chat prompts as token ids, greedy, a fixed number of new tokens (no early stop), the same
number of threads, runs alternating in one process - one process per row (final.bench.isolate), so a crash of
llama.cpp (SIGILL in its Q8_0 kernels on some CPUs) is reported in that row and the other rows are measured.
Batch 1 is llama.cpp's plain decode; batch B decodes B parallel sequences in one `llama_decode` per step through
its low-level API (one llama_batch with B seq ids: the same continuous batching its server's slots run). With
--peer-int8, our int8 weight-only mode runs beside llama.cpp's Q8_0 of the same F32 GGUF (quantized by llama.cpp itself); with --peer-bf16, our bf16 weight-only mode
beside llama.cpp's BF16 of it.

llama-cpp-python is the `bench` extra and compiles from source (~10 min on 2 cores), so it is never part of the
default install or CI; without it the section says so and how to install it.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from final.bench.isolate import isolated
from final.bench.throughput import chat_prompts
from final.bench.timing import on_own_thread, read_rate, side_by_side, timed
from final.engine import EmbeddedEngine
from final.models import cache_dir, smollm2_gguf_path

INSTALL = ('pip install "final[bench]"  (llama-cpp-python, compiled from source: about 10 minutes on 2 cores; '
           'CMAKE_ARGS="-DGGML_NATIVE=ON" builds for this CPU)')


def gguf_source(model_name: str) -> Path | None:
    """The GGUF a model was converted from, where it has one (None: the peer cannot be given the same weights)."""
    if model_name == "builtin:smollm2-135m-instruct":
        return smollm2_gguf_path()
    path = Path(model_name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def f32_gguf(src: Path) -> Path:
    """`src` with every tensor dequantized to F32 (metadata copied), built once into $FINAL_CACHE/gguf."""
    import gguf

    out = cache_dir() / "gguf" / f"{src.stem}.F32.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = gguf.LlamaFileType.ALL_F32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


# our weight-only modes and the llama.cpp file type each stands beside
PEER_TYPES = {"int8": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0"), "bf16": ("BF16", "LLAMA_FTYPE_MOSTLY_BF16")}


def quantized_gguf(f32: Path, mode: str, threads: int) -> Path:
    """llama.cpp's own conversion of the F32 GGUF to the type beside our `mode` (what `llama-quantize model.gguf
    Q8_0` or `BF16` writes)."""
    import llama_cpp as L

    name, ftype = PEER_TYPES[mode]
    out = f32.with_name(f32.name.replace(".F32.", f".{name}."))
    if out.exists():
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    _quiet_logs(L)
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, ftype)
    params.nthread = threads
    if L.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {f32}")
    os.replace(tmp, out)
    return out


class LlamaCpp:
    """One llama.cpp model + context, driven through the low-level API: greedy, fixed length, B sequences."""

    def __init__(self, path: Path, threads: int, max_rows: int, max_tokens: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        _quiet_logs(L)
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_seq_max = max_rows
        cp.n_ctx = max_rows * max_tokens  # split per sequence unless kv_unified
        cp.n_batch = cp.n_ubatch = max(512, max_rows * max_tokens)
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(cp.n_batch, 0, max_rows)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        row = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
        return int(row.argmax())

    def clear(self) -> None:
        """Forget every sequence's tokens."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        """Greedy `new_tokens` per prompt, all prompts as parallel sequences. Returns ids, prefill s, decode s."""
        self.clear()
        t0 = time.perf_counter()
        out, first = self.extend(prompts, [0] * len(prompts), new_tokens)
        return out, first - t0, time.perf_counter() - first

    def extend(self, news: list[list[int]], starts: list[int], new_tokens: int) -> tuple[list[list[int]], float]:
        """Sequence s (kept in the context from earlier calls: its first starts[s] positions) continues with the
        tokens news[s] (at least one), then `new_tokens` greedy tokens; all sequences in parallel. Returns the new
        tokens and the perf_counter time the first of them was known (the time to first token's end)."""
        entries = [(tok, start + i, s, i == len(p) - 1) for s, (p, start) in enumerate(zip(news, starts))
                   for i, tok in enumerate(p)]
        self._decode(entries)
        last = [i for i, e in enumerate(entries) if e[3]]
        out = [[self._argmax(i)] for i in last]
        first = time.perf_counter()
        ends = [start + len(p) for p, start in zip(news, starts)]
        for step in range(1, new_tokens):
            self._decode([(row[-1], end + step - 1, s, True) for s, (end, row) in enumerate(zip(ends, out))])
            for s, row in enumerate(out):
                row.append(self._argmax(s))
        return out, first

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


_QUIET: Any = None  # llama.cpp keeps the callback pointer: hold it for the process's life


def _quiet_logs(L: Any) -> None:
    """llama.cpp logs every load to stderr; the bench prints its own table."""
    global _QUIET
    if _QUIET is None:
        _QUIET = L.llama_log_callback(lambda level, text, user_data: None)
    L.llama_log_set(_QUIET, ctypes.c_void_p(0))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Rows with identical tokens, and the mean length of the common prefix (greedy paths part after a tie)."""
    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    prefixes = [common(a, b) for a, b in zip(ours, theirs)]
    return {"rows_identical": f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}",
            "mean_common_prefix": round(sum(prefixes) / max(len(prefixes), 1), 1),
            "first_ids_ours": ours[0][:8], "first_ids_llama_cpp": theirs[0][:8]}


def llama_cpp_weights(model_name: str) -> tuple[Path | None, str]:
    """The F32 GGUF of the model's own weights for llama.cpp, or None and why not (llama-cpp-python missing, or
    no GGUF the model was converted from)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # not installed, or its shared library failed to load
        return None, f"llama_cpp is not importable ({type(exc).__name__}: {exc})"
    src = gguf_source(model_name)
    if src is None:
        return None, (f"{model_name} has no GGUF to give llama.cpp the same weights: use "
                      "builtin:smollm2-135m-instruct or a .gguf model path")
    return f32_gguf(src), ""


def skipped(reason: str) -> dict:
    return {"peer": {"skipped": reason, "install": INSTALL}}


def run_peer(model_name: str, model_dir: str, batches: list[int], new_tokens: int, repeats: int,
             device: str = "cpu", int8: bool = False, bf16: bool = False) -> dict:
    """The `peer` section: ours vs llama.cpp per batch size (fp32 vs F32; with int8, int8 vs Q8_0; with bf16, our
    bf16 weights vs BF16), or why not."""
    if device != "cpu":
        return skipped(f"llama.cpp is measured on CPU only (device {device})")
    f32, why_not = llama_cpp_weights(model_name)
    if f32 is None:
        return skipped(why_not)
    import llama_cpp
    import torch
    from transformers import AutoTokenizer

    threads = torch.get_num_threads()
    src = gguf_source(model_name)
    modes = ["fp32"] + [m for m, on in (("int8", int8), ("bf16", bf16)) if on]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows, fp32_ids, fp32_theirs = [], {}, {}
    for mode in modes:
        for batch in batches:
            # each row in its own process: llama.cpp's crash (SIGILL in a Q8_0 kernel) is that row's report
            row = isolated("final.bench.peer:measure_row", dict(
                model_dir=model_dir, f32=str(f32), mode=mode, prompts=chat_prompts(tokenizer, batch),
                new_tokens=new_tokens, repeats=repeats, threads=threads))
            row.update(mode=mode, batch=batch)
            if "_ours" not in row:
                pass  # crashed or failed: reported as such
            elif mode == "fp32":
                fp32_ids[batch], fp32_theirs[batch] = row.pop("_ours"), row.pop("_theirs")
            elif batch in fp32_ids:  # how far each side's smaller weights stray from its own fp32 tokens
                row["ours_vs_our_fp32"] = agreement(row.pop("_ours"), fp32_ids[batch])
                row["llama_cpp_vs_its_f32"] = agreement(row.pop("_theirs"), fp32_theirs[batch])
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return {"peer": {"engine": f"llama.cpp via llama-cpp-python {llama_cpp.__version__}", "threads": threads,
                     "new_tokens": new_tokens, "source_gguf": src.name, "rows": rows,
                     "batched": "batch B: B parallel sequences, one llama_decode per step (low-level llama_batch)",
                     "timing": "whole call (prefill + all new tokens) on both sides, medians of alternating runs; "
                               "(decode) and the decode lines count decode steps only (ours: the whole "
                               "call less a one-token call of the same prompts)"}}


def measure_row(model_dir: str, f32: str, mode: str, prompts: list[list[int]], new_tokens: int, repeats: int,
                threads: int) -> dict:
    """One row of the section, run by final.bench.isolate in its own process: `mode` fp32 (the F32 GGUF), int8
    (llama.cpp's Q8_0 of it) or bf16 (its BF16)."""
    import torch

    torch.set_num_threads(threads)
    weights = Path(f32) if mode == "fp32" else quantized_gguf(Path(f32), mode, threads)
    row = _measure(model_dir, weights, prompts, new_tokens, repeats, threads, None if mode == "fp32" else mode)
    return {**row, "peer_weights": weights.name}


def _measure(model_dir: str, weights: Path, prompts: list[list[int]], new_tokens: int, repeats: int, threads: int,
             quantization: str | None) -> dict:
    """One row: our engine and llama.cpp, alternating on the engine thread (so one thread runs all the work)."""
    import statistics

    B = len(prompts)
    # llama.cpp clears its context before each call, so ours keeps no prefix cache between the repeats either
    engine = EmbeddedEngine(model_dir, dtype="float32", max_running_requests=B, quantization=quantization,
                            max_model_len=max(map(len, prompts)) + new_tokens + 1, prefix_cache=False)
    try:
        peer = engine.call(lambda _r: LlamaCpp(weights, threads, B, max(map(len, prompts)) + new_tokens + 1))
        got: dict[str, Any] = {"decode": []}
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

        def theirs() -> None:
            got["theirs"], _, decode_s = engine.call(lambda _r: peer.generate(prompts, new_tokens))
            got["decode"].append(decode_s)

        def ours() -> None:
            got["ours"] = [o["output_ids"] for o in engine.generate(prompts, params)]

        reads = [on_own_thread(read_rate)]
        pair = side_by_side(theirs, ours, repeats, warmup=1)
        reads.append(on_own_thread(read_rate))
        # our prefill and first token alone, so our decode steps can be counted as llama.cpp's are
        first = statistics.median(timed(lambda: engine.generate(prompts, {**params, "max_new_tokens": 1}))[0]
                                 for _ in range(repeats))
        reads.append(on_own_thread(read_rate))
        weight_bytes = engine.call(lambda _r: step_bytes(engine.model))
        engine.call(lambda _r: peer.close())
    finally:
        engine.shutdown()
    tokens = B * new_tokens
    ours_decode = B * (new_tokens - 1) / max(pair.ours_s - first, 1e-9)
    theirs_decode = B * (new_tokens - 1) / statistics.median(got["decode"][1:])
    row = {"ours_tok_s": round(tokens / pair.ours_s, 2), "llama_cpp_tok_s": round(tokens / pair.reference_s, 2),
           "ratio": round(pair.reference_s / pair.ours_s, 3),
           "ours_decode_tok_s": round(ours_decode, 2), "llama_cpp_decode_tok_s": round(theirs_decode, 2),
           "agreement": agreement(got["ours"], got["theirs"]), "_ours": got["ours"], "_theirs": got["theirs"]}
    if quantization is None and B == 1:  # both read the same fp32 matrices a step, at one row memory-bound
        row["roofline"] = {"weight_mb_per_step": round(weight_bytes / 2**20, 1),
                           "ours_gb_s": round(weight_bytes * ours_decode / 1e9, 2),
                           "llama_cpp_gb_s": round(weight_bytes * theirs_decode / 1e9, 2),
                           "sum_gb_s": round(statistics.median(reads) / 1e9, 2)}
    return row


def step_bytes(model: Any) -> int:
    """The weight bytes one decode step streams: every layer's matrices and the lm_head (the tied embedding) once;
    norms are noise, and the K/V of these short rows adds under 1%."""
    linears = [model.lm_head] + [lin for layer in model.layers
                                 for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    return sum(lin.nbytes for lin in linears)


def describe(peer: dict) -> list[str]:
    """The peer section's lines for `final bench`'s table."""
    if "skipped" in peer:
        return [f"  skipped: {peer['skipped']}", f"  install: {peer['install']}"]
    lines = [f"  {peer['engine']}, {peer['threads']} threads, {peer['new_tokens']} new tokens; {peer['batched']}",
             f"  {'mode':5} {'batch':>5} {'ours':>8} {'llama.cpp':>10} {'(decode)':>9} {'ratio':>7} "
             f"{'rows identical':>15} {'common prefix':>14}"]
    for r in peer["rows"]:
        if "crashed" in r or "failed" in r:
            lines.append(f"  {r['mode']:5} {r['batch']:>5} {'crashed' if 'crashed' in r else 'failed'}: "
                         f"{r.get('crashed') or r.get('failed')}")
            continue
        a = r["agreement"]
        lines.append(f"  {r['mode']:5} {r['batch']:>5} {r['ours_tok_s']:>8.1f} {r['llama_cpp_tok_s']:>10.1f} "
                     f"{r['llama_cpp_decode_tok_s']:>9.1f} {r['ratio']:>6.2f}x {a['rows_identical']:>15} "
                     f"{a['mean_common_prefix']:>14}")
        if "roofline" in r:
            f = r["roofline"]
            lines.append(f"        decode steps only: ours {r['ours_decode_tok_s']:.1f} tok/s, llama.cpp "
                         f"{r['llama_cpp_decode_tok_s']:.1f}; each streams {f['weight_mb_per_step']} MB of weights a "
                         f"step: ours {f['ours_gb_s']} GB/s, llama.cpp {f['llama_cpp_gb_s']} GB/s "
                         f"({f['llama_cpp_gb_s'] / f['ours_gb_s']:.0%} of ours); a 128 MB sum reads "
                         f"{f['sum_gb_s']} GB/s beside them")
        if "ours_vs_our_fp32" in r:
            b = r["ours_vs_our_fp32"]
            c = r["llama_cpp_vs_its_f32"]
            lines.append(f"        vs own fp32: ours {b['rows_identical']} rows identical (mean common prefix "
                         f"{b['mean_common_prefix']}), llama.cpp {PEER_TYPES[r['mode']][0]} vs F32 "
                         f"{c['rows_identical']} "
                         f"({c['mean_common_prefix']})")
    return lines + [f"  {peer['timing']}"]
