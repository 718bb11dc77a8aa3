"""Where a question's attention goes when two prefixes are served together, and how loud each prefix is.

    .venv/bin/python experiments/cartridge_loudness.py A.pt B.pt --sets brennock,kestrel [--split tune] [--limit N]

For each set's questions (its right option appended, as `final cartridge eval` scores it), after: the set's own
document alone, both documents as two prefilled KVs side by side (each at positions 0.., as two cartridges are
served), its cartridge alone, and both cartridges (the set's own first). Per prefix it prints the attention mass
the question and answer tokens give the prefix's positions (its first token, every sequence's attention sink,
counted apart under `sinks`) and the prefix's *loudness*: the norm of its part of the attention output,
sum_j a_j v_j over its positions, averaged over layers, heads and query tokens (and over layers 20-29 alone).
A document beside another is quiet where a question is not about it; issue 42's composition gap is a trained
cartridge that is not (bench/RESULTS.md). Runs the model through transformers with eager attention, the one
implementation that returns attention weights; the engine's kernels do not. Contacts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LATE = slice(20, None)


def _kv_of(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cart(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from final.cartridges.format import load_cartridge

    kv = load_cartridge(path)
    return [(k.float(), v.float()) for k, v in zip(kv.keys, kv.values)]


def measure(model, prompts: list[list[int]], segments: list[tuple[str, list]]) -> dict[str, torch.Tensor]:
    """Per-layer means over `prompts` of each segment's attention mass (sink apart) and loudness (the training
    term's own measure, final.training.quiet, so the bench reports what `learn --quiet-partner` trains down)."""
    from contextlib import ExitStack

    from transformers import DynamicCache

    from quiet import measured

    layers = len(segments[0][1])
    out: dict[str, torch.Tensor] = {}

    def add(key: str, layer: int, x: torch.Tensor) -> None:
        out.setdefault(key, torch.zeros(layers))[layer] += float(x) / len(prompts)

    lengths = [kv[0][0].shape[2] for _, kv in segments]
    starts, total = [sum(lengths[:s]) for s in range(len(lengths))], sum(lengths)
    for ids in prompts:
        cache = DynamicCache()
        for i in range(layers):
            cache.update(torch.cat([kv[i][0] for _, kv in segments], 2),
                         torch.cat([kv[i][1] for _, kv in segments], 2), i)
        where = torch.ones(1, len(ids), dtype=torch.bool)
        with torch.no_grad(), ExitStack() as stack:
            loud = [stack.enter_context(measured(model, at + 1, at + n, where)) for at, n in zip(starts, lengths)]
            attentions = model(torch.tensor([ids]), past_key_values=cache, output_attentions=True).attentions
        for i, a in enumerate(attentions):  # [1, heads, queries, keys]
            a = a[0].float()
            for at, n, (name, _), heard in zip(starts, lengths, segments, loud):
                add(f"mass {name}", i, a[:, :, at + 1:at + n].sum(-1).mean())
                add("mass sinks", i, a[:, :, at].mean())
                add(f"loud {name}", i, heard.layers[i].mean())
            add("mass prompt", i, a[:, :, total:].sum(-1).mean())
    return out


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from final.training.evaluate.questions import load_qa
    from final.training.teacher import teacher_ids
    from final.models import DEFAULT_MODEL
    from final.models import resolve_model_path
    from final.prompts import continuation_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cartridges", nargs=2, type=Path, help="the two sets' cartridges, in --sets order")
    p.add_argument("--sets", required=True, help="two question sets in data/qa, e.g. brennock,kestrel")
    p.add_argument("--split", choices=("tune", "test", "all"), default="tune")
    p.add_argument("--limit", type=int, help="ask only the first N questions of each set")
    args = p.parse_args()
    names = args.sets.split(",")
    if len(names) != 2:
        p.error("--sets names two question sets")
    torch.set_grad_enabled(False)
    path = resolve_model_path(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    qa = ROOT / "data" / "qa"
    docs = {n: _kv_of(model, teacher_ids(tok, (qa / f"{n}.txt").read_text())) for n in names}
    carts = {n: _cart(c) for n, c in zip(names, args.cartridges)}
    print("| questions | prefixes | mass: own / other / sinks / prompt | loudness: own / other (layers 20-29) |")
    print("|---|---|---|---|")
    for own, other in (names, names[::-1]):
        split = None if args.split == "all" else args.split
        questions = load_qa(qa / f"{own}.jsonl", split).questions[:args.limit]
        prompts = [continuation_ids(tok, q.question) + tok(q.choices[q.answer], add_special_tokens=False).input_ids
                   for q in questions]
        for label, segs in ((f"document {own}", [("own", docs[own])]),
                            ("both documents, two KVs", [("own", docs[own]), ("other", docs[other])]),
                            (f"cartridge {own}", [("own", carts[own])]),
                            ("both cartridges", [("own", carts[own]), ("other", carts[other])])):
            r = measure(model, prompts, segs)
            get = lambda k: r.get(k, torch.full((1,), float("nan")))  # noqa: E731 - a missing segment prints nan
            mass = " / ".join(f"{get('mass ' + k).mean():.3f}" for k in ("own", "other", "sinks", "prompt"))
            loud = " / ".join(f"{get('loud ' + k).mean():.3f} ({get('loud ' + k)[LATE].mean():.3f})"
                              for k in ("own", "other"))
            print(f"| {own} ({len(questions)}) | {label} | {mass} | {loud} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
