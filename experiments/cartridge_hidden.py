"""How far a cartridge moves the model's hidden states from the document's, layer by layer, on a QA set's questions.

    .venv/bin/python experiments/cartridge_hidden.py LABEL=CART.pt [LABEL=CART.pt ...] --set brennock [--split tune]

For each question with its right option appended (as `final cartridge eval` scores it), read after the whole
document (the teacher: the document as the system turn) and after each cartridge, the whitened squared error of
every layer's output state - per dimension over the teacher's spread across the questions' tokens, the measure
`learn --hidden` trains down (final/distill/hidden.py) - averaged over the tokens; the first p tokens of the
document (p: the first cartridge's length) are printed beside as a baseline. A number near 0 is a model that
reads the questions as it does after the document; a cartridge can fit its training rows' answers while moving
the states far off. Contacts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_layer(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> list[float]:
    from final.training.hidden import hidden_error

    return [float(hidden_error([s], [t])) for s, t in zip(mine, theirs)]


def main() -> int:
    from transformers import AutoTokenizer

    from final.cartridges.format import load_cartridge
    from final.training.hidden import HiddenTeacher
    from final.training.evaluate.questions import load_qa
    from final.training.student import Student
    from final.models import DEFAULT_MODEL
    from final.models import resolve_model_path
    from final.prompts import continuation_ids, document_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cartridges", nargs="+", help="LABEL=PATH: the cartridges of the set's document")
    p.add_argument("--set", required=True, help="a question set in data/qa, e.g. brennock")
    p.add_argument("--split", choices=("tune", "test", "all"), default="tune")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    path = resolve_model_path(DEFAULT_MODEL)
    tok, student = AutoTokenizer.from_pretrained(str(path)), Student(path)
    qa = load_qa(ROOT / "data" / "qa" / f"{args.set}.jsonl", None if args.split == "all" else args.split)
    rows = [continuation_ids(tok, q.question) + tok(q.choices[q.answer], add_special_tokens=False).input_ids
            for q in qa.questions]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    where = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], where[i, :len(r)] = torch.tensor(r), True
    doc = document_ids(tok, qa.document)
    theirs = HiddenTeacher(student, doc).states(ids, where)
    prefixes = []
    for given in args.cartridges:
        label, _, file = given.partition("=")
        kv = load_cartridge(file)
        prefixes.append((label, [k.float() for k in kv.keys], [v.float() for v in kv.values]))
    p_tokens = prefixes[0][1][0].shape[2]
    prefixes.append((f"first {p_tokens} tokens", *student.prefill(doc[:p_tokens])))
    layers = len(theirs)
    print(f"{args.set} ({args.split}, {len(rows)} questions, {int(where.sum())} tokens): whitened error per layer")
    print("| prefix | mean | " + " | ".join(f"L{i}" for i in range(0, layers, 3)) + " | last |")
    print("|---|---:|" + "---:|" * (len(range(0, layers, 3)) + 1))
    for label, keys, values in prefixes:
        e = per_layer(student.states(keys, values, ids, where), theirs)
        print(f"| {label} | {sum(e) / layers:.3f} | " + " | ".join(f"{x:.2f}" for x in e[::3]) + f" | {e[-1]:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
