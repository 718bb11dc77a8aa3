"""What a `learn` start is worth before any step: the chunked select / match start saved as a cartridge.

    .venv/bin/python experiments/cartridge_start.py --text DOC.txt --rows OUT.facts.jsonl --tokens P --out START.pt
        [--init select|match] [--chunk-tokens N]

`learn --init select|match` (final/distill/chunks.py) cuts the cartridge's start from the document's own KV, chunk
by chunk, by the attention of each chunk's fact rows (`--rows`: the rows `learn` wrote beside a cartridge of the
same document). This builds that start alone and saves it with a manifest, so `final cartridge eval START.pt --qa
...` judges it as it would a trained one (bench/RESULTS.md, issue 42's long document). Contacts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from transformers import AutoTokenizer

    from final.cartridges.format import save_cartridge
    from final.cartridges.manifest import CartridgeManifest
    from final.training.settings import INITS
    from final.training.start.initial import observed, select_start
    from final.training.teacher import teacher_ids
    from final.training.rows import read_conversations
    from final.training.student import Student, TrainableKV
    from final.training.settings import TrainConfig
    from final.models import DEFAULT_MODEL
    from final.models import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", required=True, type=Path)
    p.add_argument("--rows", required=True, type=Path, help="the document's fact rows (learn's OUT.facts.jsonl)")
    p.add_argument("--tokens", required=True, type=int)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--init", choices=[i for i in INITS if i != "prefix"], default="select")
    p.add_argument("--model", default=DEFAULT_MODEL)
    args = p.parse_args()
    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    student = Student(path)
    t0 = time.perf_counter()
    frozen = TrainConfig.frozen_tokens  # the sink learn keeps fixed
    rows = observed(read_conversations(args.rows, student.vocab_size))
    kv = select_start(student, path, teacher_ids(tok, args.text.read_text()), rows, args.tokens, frozen, args.init)
    cart = TrainableKV(*kv, frozen).cartridge(student.dtype)
    out = save_cartridge(cart, args.out)
    CartridgeManifest.describe(cart, out, cartridge_id=out.stem, model_id=args.model, source_document=str(args.text),
                               labels={"format": "chat", "init": args.init, "steps": "0"},
                               positions="after_prefix").write(out)
    print(f"wrote {out} ({cart.num_tokens} tokens, {args.init} start) in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
