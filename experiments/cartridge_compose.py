"""Do two cartridges served together still know both documents? QA accuracy of a composition (data/qa sets).

    .venv/bin/python experiments/cartridge_compose.py CART_A CART_B [--sets brennock,kestrel] [--split tune]
        [--work DIR] [--one-order] [--open-tokens 32] [--positions after_prefix|from_zero]
        [--variant concatenated|aligned|one-sink]
    .venv/bin/python experiments/cartridge_compose.py --first-tokens 64 [--sets brennock,kestrel] ...

CART_A stands for the first set's document, CART_B for the second's (e.g. `final cartridge distill` outputs);
`--first-tokens P` instead builds each document's first-P-token prefix cartridge (the `prefix` start of
`final cartridge distill`, no training) into --work and uses those. Then final.training.evaluate.composed on each set's
--split half (tune unless told: the test half is for final figures only): no document, each document in context,
both documents in one system turn (both orders unless --one-order), each cartridge alone, both cartridges composed
as the store serves `cartridge=[a, b]` - MC acc / acc_norm with 95% Wilson intervals, the ratio composed / own
cartridge alone, open answers, KL to the set's own document in context. Prints a markdown table per set and writes
summary.json in --work. `--variant` tests a serving-side explanation of what composition loses (bench/RESULTS.md):
`aligned` rotates each cartridge's keys forward by the other's length, so the prompt after [A, B] sits at the
distance from each that it trained at; `one-sink` drops B's first token (the attention sink every sequence's token
0 becomes), so the composition holds one. The "alone" rows then show the changed cartridges alone. The same
figures as `final cartridge eval CART_A --qa A.jsonl --compose CART_B --compose-qa B.jsonl`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
QA = ROOT / "data" / "qa"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("carts", nargs="*", type=Path, help="CART_A CART_B: the two sets' cartridges, in --sets order")
    p.add_argument("--first-tokens", type=int, help="build the documents' first-P-token prefix cartridges instead")
    p.add_argument("--sets", default="brennock,kestrel", help="the two question sets (data/qa/NAME.jsonl)")
    p.add_argument("--split", choices=("tune", "test", "all"), default="tune")
    p.add_argument("--one-order", action="store_true", help="both documents in context only in --sets order")
    p.add_argument("--open-tokens", type=int, default=32)
    p.add_argument("--positions", choices=("after_prefix", "from_zero"), help="both cartridges' convention "
                   "(default: each one's manifest or run config)")
    p.add_argument("--variant", choices=("concatenated", "aligned", "one-sink"), default="concatenated",
                   help="change the two cartridges before composing them (default: served as they are)")
    p.add_argument("--work", type=Path, default=Path("/tmp/cartridge_compose"))
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    args = p.parse_args(argv)
    names = args.sets.split(",")
    if len(names) != 2 or (len(args.carts) == 2) == (args.first_tokens is not None):
        p.error("give two --sets and either two cartridge files or --first-tokens P")
    from final.training.evaluate.questions import load_qa
    from final.training.evaluate.composed import ComposeSet, compose_evaluate, compose_table
    from final.inf import local_engine

    sets = [load_qa(QA / f"{n}.jsonl", None if args.split == "all" else args.split) for n in names]
    args.work.mkdir(parents=True, exist_ok=True)
    inference = local_engine(args.model, dtype="float32")
    try:
        carts = _variant(_cartridges(inference, args, sets), args.variant, inference.model_dir)
        result = compose_evaluate(inference, *(ComposeSet(qa.name, qa.document, qa.questions, cart)
                                               for qa, cart in zip(sets, carts)),
                                  open_tokens=args.open_tokens, both_orders=not args.one_order)
    finally:
        inference.shutdown()
    summary = {"sets": names, "split": args.split, "cartridges": [str(c) for c in args.carts] or None,
               "first_tokens": args.first_tokens, "separator": result.separator, "composed": result.composed,
               "keeps": result.keeps(), "pooled": result.pooled(),
               "rows": {n: [dataclasses.asdict(r) for r in result.rows[n]] for n in names}, "ratios": result.ratios}
    (args.work / "summary.json").write_text(json.dumps(summary, indent=2))
    for qa in sets:
        print(f"\n{qa.name} ({args.split}, {len(qa.questions)} questions)")
        print(compose_table(result, qa.name))
    keeps, pooled = (("-" if x is None else f"{x:.2f}x") for x in (summary["keeps"], summary["pooled"]))
    print(f"\ncomposed / alone (MC acc): the smaller over both sets {keeps}, pooled {pooled}; "
          f"wrote {args.work / 'summary.json'}")
    return 0


def _cartridges(inference, args: argparse.Namespace, sets) -> list:
    """The two cartridges as served: read from the files given, or built from the first P tokens (and saved)."""
    from final.cartridges.build import build_from_text
    from final.cartridges.format import save_cartridge
    from final.cartridges.service import CartridgeService
    from final.training.start.initial import initial_ids

    if args.first_tokens is None:
        service = CartridgeService(inference.engine, inference.model_dir)
        return [service.read_served(path, positions=args.positions) for path in args.carts]
    carts = [build_from_text(inference.engine, initial_ids(inference.tokenizer, qa.document, args.first_tokens))
             for qa in sets]
    for qa, cart in zip(sets, carts):
        save_cartridge(cart, args.work / f"{qa.name}_first{args.first_tokens}.pt")
    return carts


def _variant(carts: list, variant: str, model_dir) -> list:
    from final.cartridges.format import CartridgeKV
    from final.cartridges.positions import moved

    a, b = carts
    if variant == "aligned":
        return [moved(a, b.num_tokens, model_dir, "aligned"), moved(b, a.num_tokens, model_dir, "aligned")]
    if variant == "one-sink":
        return [a, CartridgeKV([k[:, :, 1:] for k in b.keys], [v[:, :, 1:] for v in b.values],
                               max(0, b.num_frozen_tokens - 1))]
    return carts

if __name__ == "__main__":
    sys.exit(main())
