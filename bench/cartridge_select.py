"""How far the `select` start goes before any training: held-out KL of cut document caches against prefixes.

    .venv/bin/python bench/cartridge_select.py [--tokens 64,128,256] [--first 64,128,256,512] [--observe 16,32]

For each observation count (self-study conversations the teacher reads, final.training.onpolicy.conversations.observe) and each p:
the `select` cartridge of final/distill/select.py (each KV head's p most attended positions, keys moved by
R_{p-L}), and the same positions with the keys left where they were (to show what the move is for); and the
document's first p tokens for each --first. Judged as bench/cartridge_distill.py judges (its held-out rows: 48 from
6 chunks, seed 10,000; `final.training.evaluate.heldout`, KL per answer token to the teacher reading the whole document).
SmolLM2-135M-Instruct fp32 on bench/data/vellmark.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # cartridge_distill: its held-out rows and judge
INTS = lambda v: [int(x) for x in v.split(",") if x]  # noqa: E731


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "cartridge_distill",
                    help="where bench/cartridge_distill.py keeps its held-out rows (made here if missing)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--tokens", type=INTS, default=[64, 128, 256])
    ap.add_argument("--first", type=INTS, default=[64, 128, 256, 512])
    ap.add_argument("--observe", type=INTS, default=[16, 32])
    ap.add_argument("--ridge", type=lambda v: [float(x) for x in v.split(",") if x], default=[1e-3],
                    help="the `match` variant's ridge values (final.training.start.match)")
    ap.add_argument("--sequential", type=lambda v: [float(x) for x in v.split(",") if x], default=[],
                    help="ridge values of the sequential `match` variant (each layer fitted to the student's queries)")
    ap.add_argument("--unmoved", action="store_true", help="also the select keys left where they were")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def judge_starts(inference, text, rows, student, observed, p: int, count: int, args) -> None:
    """One p's starts cut from what the teacher's observed conversations attend to, each judged on the held-out rows.
    observed: (the teacher's document ids, its conversations, the document's keys and values, their attention mass)."""
    from cartridge_distill import judge

    from final.cartridges.format import CartridgeKV
    from final.training.start.match import fit_values
    from final.training.start.select import gather_kv, select_kv, select_positions
    from final.models import resolve_model_path

    doc_ids, convs, keys, values, mass = observed
    model_dir = resolve_model_path(args.model)
    positions = select_positions(mass, p, 1)
    kept_k, kept_v = select_kv(keys, values, positions, model_dir)
    carts = [("select", CartridgeKV(kept_k, kept_v, 1))]
    if args.unmoved:
        carts.append(("select, keys not moved", CartridgeKV(*gather_kv(keys, values, positions), 1)))
    for ridge, sequential in [(r, False) for r in args.ridge] + [(r, True) for r in args.sequential]:
        t0 = time.perf_counter()
        fitted = fit_values(student, doc_ids, convs, positions, kept_k, kept_v, 1, ridge,
                            sequential)
        print(f"(fitting took {time.perf_counter() - t0:.1f} s)", flush=True)
        name = f"match{', sequential' if sequential else ''}, ridge {ridge:g}"
        carts.append((name, CartridgeKV(kept_k, fitted, 1)))
    for name, cart in carts:
        kl = judge(inference, text, rows, cart)["cartridge"]
        print(f"| {name}, p={p}, {count} conversations | {p} | {kl:.4f} |", flush=True)


def main() -> int:
    args = parse_args()
    from cartridge_distill import DOC, heldout, judge

    from final.cartridges.build import build_from_text
    from final.training.onpolicy.loop import DistillConfig
    from final.training.onpolicy.conversations import observe
    from final.training.start.select import attention_mass
    from final.training.teacher import ChunkContext, teacher_system
    from final.training.student import Student
    from final.inf import local_engine
    from final.models import resolve_model_path
    from final.prompts import document_ids

    text = DOC.read_text()
    args.work.mkdir(parents=True, exist_ok=True)
    inference = local_engine(args.model, dtype="float32")
    try:
        ns = argparse.Namespace(heldout=48, heldout_batch=8, heldout_answer_tokens=128, seed=args.seed)
        rows = heldout(inference, text, args.work, ns)
        print(f"{len(rows)} held-out rows")
        for p in args.first:
            cart = build_from_text(inference.engine, document_ids(inference.tokenizer, text)[:p])
            print(f"| first {p} tokens | - | {judge(inference, text, rows, cart)['cartridge']:.4f} |", flush=True)
        model_dir = resolve_model_path(args.model)
        student = Student(model_dir, "cpu", "float32")
        doc = inference.tokenizer(text, add_special_tokens=False).input_ids
        for count in args.observe:
            cfg = DistillConfig(tokens=max(args.tokens), init_questions=count, seed=args.seed)
            t0 = time.perf_counter()
            with ChunkContext(inference, teacher_system(text), "__select-bench") as teacher:
                _, convs = observe(inference, teacher, doc, cfg)
                mass = attention_mass(student, teacher.doc_ids, convs)
                keys, values = student.prefill(teacher.doc_ids)
                observed = (teacher.doc_ids, convs, keys, values, mass)
            print(f"(observing {count} conversations took {time.perf_counter() - t0:.1f} s)", flush=True)
            for p in args.tokens:
                judge_starts(inference, text, rows, student, observed, p, count, args)
    finally:
        inference.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
