"""LoRA on the embedded engine (issue 82), three parts, each printed as a table:

updates   a trainer's adapter update (`update_weights(lora tensors, peft_config=...)`: merged into the kept base,
          final/adapters/merge.py) at each rank against a full update of every parameter, median of --repeats
          (alternating two sets of values); the first adapter update, which reads the bases, apart.
decode    tokens a second of one `generate` of --rows rows x --new-tokens (greedy, ignore_eos, 20-token prompts):
          the base alone (the kernel's whole-step decode); every row on one adapter; each row its own adapter
          (--adapters); half the rows base, half adapter - all per row (final/engine/lora.py: the base product
          once, each row's delta) - beside the alternative of one merged copy of the model per adapter: a batch of
          one adapter is the base's speed on its copy, a batch of N adapters N passes of its rows (each over its
          own copy, a model's worth of memory each; timed on one copy, which streams from memory all the same
          when the model is larger than the cache). Ratios against the base alone, measured side by side.
equality  greedy tokens and log-probs of each adapter against HF + PEFT (PeftModel, fp32) on the same prompts,
          per row from disk and merged by update_weights, before and after an update (figures that do not
          depend on time).

    .venv/bin/python bench/lora.py                                   # SmolLM2-135M, ranks 8 16 64, batch 4
    .venv/bin/python bench/lora.py --model builtin:tiny-random-llama --repeats 1 --new-tokens 8   # a quick check

Adapters are PEFT's own (get_peft_model on all-linear, init_lora_weights=False, B scaled by --b-scale so the
model still answers: a trained adapter's size), saved with save_pretrained.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Name three prime numbers.",
           "Explain what a cache is in one sentence."]


def peft_adapter(model_dir: str, r: int, seed: int, b_scale: float):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear",
                                            task_type="CAUSAL_LM", init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    return model.eval()


def lora_state(model) -> dict:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def config(model: str, rows: int) -> dict:
    return {"model_path": model, "progress": False, "rollout": {"name": "local", "prompt_length": 256,
                                                                "response_length": 128, "max_num_seqs": rows}}


def median_s(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_updates(args, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from final.inf import InferenceEngine

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    fulls = [{k: v + torch.randn(v.shape, generator=torch.Generator().manual_seed(s)) * 1e-3
              for k, v in base.items()} for s in range(2)]
    print(f"\n## updates ({args.model}, median of {args.repeats})\n")
    print("| update | tensors | MiB | first ms | ms | / full |")
    print("|---|---:|---:|---:|---:|---:|")
    with InferenceEngine(config(args.model, 1)) as eng:
        full_ms = 1000 * median_s(lambda i: eng.update_weights(fulls[i % 2]), args.repeats)
        mib = sum(v.numel() * v.element_size() for v in base.values()) / 2**20
        print(f"| full | {len(base)} | {mib:.0f} | - | {full_ms:.1f} | 1.00x |")
        for r in args.ranks:
            model = peft_adapter(model_dir, r, r, args.b_scale)
            cfg = model.peft_config["default"]
            states = [lora_state(model)]
            states.append({k: v * 0.5 for k, v in states[0].items()})
            eng.update_weights(base)  # no adapter, bases unread
            start = time.perf_counter()
            eng.update_weights(states[0], peft_config=cfg)
            first = 1000 * (time.perf_counter() - start)
            ms = 1000 * median_s(lambda i: eng.update_weights(states[(i + 1) % 2], peft_config=cfg), args.repeats)
            amib = sum(v.numel() * v.element_size() for v in states[0].values()) / 2**20
            print(f"| adapter r={r} | {len(states[0])} | {amib:.1f} | {first:.1f} | {ms:.1f} | {ms / full_ms:.2f}x |")


def part_decode(args, model_dir: str, folders: list[str]) -> None:
    from final.adapters import LiveBase, MergedAdapter, load_adapter_folder, read_adapter
    from final.engine import EmbeddedEngine

    rows, new = args.rows, args.new_tokens
    engine = EmbeddedEngine(model_dir, dtype="float32", max_running_requests=rows)
    copy_engine = EmbeddedEngine(model_dir, dtype="float32", max_running_requests=rows)  # one merged copy
    shapes = engine.parameter_shapes()
    for i, folder in enumerate(folders):
        engine.load_adapter(f"a{i}", load_adapter_folder(folder, shapes))
    named, settings = read_adapter(folders[0])
    plan = MergedAdapter(LiveBase(copy_engine.current_weights)).plan(named, shapes, peft_config=settings)
    copy_engine.update_weights(plan.named)
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    tok = engine.spec.vocab_size
    prompts = [[1] + [(37 * (i + 1) * j) % (tok - 2) + 2 for j in range(20)] for i in range(rows)]
    cases = {
        "base": lambda: engine.generate(prompts, params),
        "1 adapter": lambda: engine.generate(prompts, params, adapters="a0"),
        f"{len(folders)} adapters": lambda: engine.generate(prompts, params,
                                                           adapters=[f"a{i % len(folders)}" for i in range(rows)]),
        "half base": lambda: engine.generate(prompts, params, adapters=[None if i % 2 else "a0" for i in range(rows)]),
        "merged copy, 1 adapter": lambda: copy_engine.generate(prompts, params),
        f"merged copies, {len(folders)} adapters": lambda: [copy_engine.generate(prompts[j::len(folders)], params)
                                                            for j in range(min(len(folders), rows))],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats + 1):  # alternating, the first round warms up
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rate = {name: rows * new / statistics.median(t[1:]) for name, t in times.items()}
    same = [o["output_ids"] for o in engine.generate(prompts, params, adapters="a0")] == \
        [o["output_ids"] for o in copy_engine.generate(prompts, params)]
    print(f"\n## decode ({args.model}, {rows} rows x {new} tokens, r={args.ranks[0]}, median of {args.repeats}; "
          f"per-row adapter a0 and its merged copy give the same tokens: {same})\n")
    print("| batch | tok/s | / base |")
    print("|---|---:|---:|")
    for name, value in rate.items():
        print(f"| {name} | {value:.1f} | {value / rate['base']:.2f}x |")
    engine.shutdown()
    copy_engine.shutdown()


def part_equality(args, model_dir: str, folders: list[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from final.inf import InferenceEngine

    print(f"\n## equality with HF + PEFT ({args.model}, fp32, greedy, {args.new_tokens} tokens, {len(PROMPTS)} "
          "prompts)\n")
    print("| adapter | served | rows equal | max abs logprob diff |")
    print("|---|---|---:|---:|")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    with InferenceEngine(config(args.model, len(PROMPTS))) as eng:
        ids = eng.prepare(PROMPTS).ids
        for i, folder in enumerate(folders[:2]):
            ref_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir,
                                                                                      dtype=torch.float32), folder)
            for step in range(2):
                if step:  # a training step: new adapter values, same config
                    with torch.no_grad():
                        for name, p in ref_model.named_parameters():
                            if "lora_B" in name:
                                p.mul_(-0.5)
                    ref_model.save_pretrained(str(Path(folder).parent / f"step{i}"))
                    folder = str(Path(folder).parent / f"step{i}")
                ref = reference(ref_model.eval(), ids, args.new_tokens, eng.eos_token_ids[0])
                eng.update_weights(base)  # a plain update: the merged adapter of the last round goes
                eng.load_adapter(folder, name="x")
                for served, kw in (("per row", {"adapter": "x"}), ("merged", None)):
                    if kw is None:
                        eng.update_weights(folder)
                    out = eng.generate(PROMPTS, temperature=0, max_tokens=args.new_tokens, logprobs=True,
                                       **(kw or {}))
                    equal = sum(a == b for a, (b, _) in zip(out.token_ids, ref))
                    diff = max((abs(x - y) for m, (b, lp) in zip(out.metadata, ref) if m["response_ids"] == b
                                for x, y in zip(m["logprobs"], lp)), default=float("nan"))
                    print(f"| {Path(folder).name} (step {step}) | {served} | {equal}/{len(ids)} | {diff:.2e} |")


@torch.no_grad()
def reference(model, ids: list[list[int]], new: int, eos: int) -> list[tuple[list[int], list[float]]]:
    out = []
    for row in ids:
        got = model.generate(input_ids=torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=eos, eos_token_id=eos)[0, len(row):]
        got = got.tolist()
        got = got[:got.index(eos) + 1] if eos in got else got
        logits = model(input_ids=torch.tensor([row + got])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(row) - 1:-1].gather(1, torch.tensor(got)[:, None])[:, 0]
        out.append((got, lp.tolist()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64], help="decode uses the first")
    ap.add_argument("--adapters", type=int, default=4, help="adapters in the decode batch's mixed case")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--b-scale", type=float, default=0.05, help="lora_B scale (PEFT's random init is large)")
    ap.add_argument("--parts", default="updates,decode,equality")
    args = ap.parse_args()

    from final.bench.timing import machine
    from final.models import resolve_model_path

    model_dir = resolve_model_path(args.model)
    m = machine("cpu")
    print(f"{m['date']}, {m['cpu']} ({m['cores']} cores, load {m.get('loadavg_1min', '?')}); "
          f"{torch.get_num_threads()} threads")
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as root:
        folders = []
        if "decode" in parts or "equality" in parts:
            for i in range(args.adapters):
                folder = str(Path(root) / f"adapter{i}")
                peft_adapter(model_dir, args.ranks[0], 100 + i, args.b_scale).save_pretrained(folder)
                folders.append(folder)
        if "updates" in parts:
            part_updates(args, model_dir)
        if "decode" in parts:
            part_decode(args, model_dir, folders)
        if "equality" in parts:
            part_equality(args, model_dir, folders)


if __name__ == "__main__":
    main()
