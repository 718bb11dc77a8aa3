"""What int8 and bf16 cost in accuracy against the engine's fp32, on the bench's chat prompts.

    python bench/quant_accuracy.py                    # 8 prompts, 64 tokens, every mode
    python bench/quant_accuracy.py --modes bf16-weights

Modes: int8 and bf16-weights (`quantization: int8 | bf16`: weight-only, activations fp32), bf16 (`dtype:
bfloat16`: every tensor bf16, HF's bf16 model).
    python bench/quant_accuracy.py --prompts 16 --new-tokens 128

Two figures per mode, both against fp32 greedy decoding of the same prompts:
- greedy agreement: the mode's own greedy tokens vs fp32's (rows identical, mean common prefix);
- teacher-forced: fp32's tokens fed to the mode one decode step at a time (the path generation takes: for int8
  the gemv kernel's weight-only products, the prompt's too), mean KL(fp32 || mode) of the next-token
  distribution over every generated position, and how often the mode's argmax is fp32's token.
"""

from __future__ import annotations

import argparse
import statistics

import torch


MODES = {"int8": {"dtype": "float32", "quantization": "int8"},
         "bf16-weights": {"dtype": "float32", "quantization": "bf16"},
         "bf16": {"dtype": "bfloat16"}}


def forced_logprobs(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs [len(tokens), V] of each of `tokens` given the prompt and the tokens before it, decode-step by
    decode-step on the engine thread (the same runner calls a generation makes)."""
    from final.engine.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"max_new_tokens": len(tokens) + 1, "temperature": 0})

    def body(runner) -> torch.Tensor:
        seq = engine._make_sequence(0, prompt, params, 0, False, -1, None, ())
        seq.slot = 0
        rows = [runner.prefill([seq]).float()]
        for tok in tokens[:-1]:
            seq.append(tok, None, None)
            rows.append(runner.decode([seq]).float())
        return torch.log_softmax(torch.cat(rows), dim=-1)

    return engine.call(body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from final.bench.throughput import chat_prompts
    from final.engine import EmbeddedEngine
    from final.models import resolve_model_path

    path = resolve_model_path(args.model)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(path), args.prompts)
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}

    def run(kw: dict, tokens: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
        """(greedy tokens of each prompt, alone as at batch 1; teacher-forced log-probs of `tokens`, else of them)"""
        engine = EmbeddedEngine(path, max_model_len=max(map(len, prompts)) + args.new_tokens + 1, **kw)
        try:
            greedy = [engine.generate(p, params)["output_ids"] for p in prompts]
            return greedy, [forced_logprobs(engine, p, t) for p, t in zip(prompts, tokens or greedy)]
        finally:
            engine.shutdown()

    reference, ref_lp = run({"dtype": "float32"})
    print(f"{args.model}: {len(prompts)} chat prompts, {args.new_tokens} greedy tokens each, vs fp32")
    print("| mode | rows identical | mean common prefix | teacher-forced KL(fp32 || mode) | argmax = fp32's token |")
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes:
        greedy, forced = run(MODES[mode], reference)
        common = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(greedy, reference)]
        kls = [torch.sum(lp_ref.exp() * (lp_ref - lp), dim=-1) for lp_ref, lp in zip(ref_lp, forced)]
        hits = [(lp.argmax(-1) == torch.tensor(r)).float().mean().item() for lp, r in zip(forced, reference)]
        print(f"| {mode} | {sum(c == args.new_tokens for c in common)}/{len(prompts)} | {statistics.mean(common):.1f} "
              f"| {torch.cat(kls).mean().item():.2e} | {statistics.mean(hits):.1%} |")


if __name__ == "__main__":
    main()
