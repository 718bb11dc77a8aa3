#!/usr/bin/env python
"""GRPO through final: a policy trains in plain PyTorch/transformers while final's InferenceEngine generates its
rollouts, and after every optimizer step the new weights go into the engine with `engine.update_weights(policy)`.

    .venv/bin/python examples/grpo.py                         # SmolLM2-135M-Instruct on the CPU (defaults below)
    .venv/bin/python examples/grpo.py --device cuda           # the policy and the engine on one GPU
    .venv/bin/final generate --model grpo_out/policy --temperature 0 --max-tokens 48 \\
        'Mia has 4 bags with 3 shells in each bag. How many shells does Mia have in total? '\\
        'Write the final answer on the last line as "#### <number>".'

The task: one-step word problems made up here (add, take away, multiply small numbers), each asking for the answer
on a last line "#### <number>"; the reward is veRL's own GSM8K scorer (`verl.utils.reward_score.default_compute_score`
with data source "openai/gsm8k": 1 when the last "#### N" equals the answer, else 0). SmolLM2-135M-Instruct mostly
answers in prose or repeats "#### N" lines past the token limit, so it starts low; the train and held-out problems
come from different seeds and share no question.

One step: `engine.generate` samples `--n` completions for each of `--prompts` problems (with the engine's logprobs),
rewards are normalised within each problem's group (GRPO's advantage), the policy (fp32, on the main thread) takes
one Adam step on PPO's clipped objective with the engine's logprobs as the old policy (token mean; groups whose
completions all scored the same carry no signal and are left out; a step with none takes no optimizer step), then
`engine.update_weights(policy)` puts the full weights into the engine, which serves the new version from the next
call. With one optimizer step per rollout and a float32 engine the ratio is 1 to ~1e-5 (plain policy gradient); the
clip bounds the step where the engine's numbers differ from the policy's (`--engine-dtype bfloat16`), and
`--kl-coef` adds a k3 penalty towards the starting policy (a second copy of the model). Generation (the engine's
thread) and training (this thread) take turns, so each has every core while it runs.

Each step prints the mean reward, generation s, training s, sync ms, the policy version every row's metadata
reports (checked equal to `engine.weights_version`), the prompt tokens the engine's prefix cache served (a
prompt's n samples share one prefill; the total is printed at the end) and `gap`: the mean |policy - engine|
logprob of the sampled tokens before the step, at float32 rounding (~1e-6) only if the engine serves exactly the trainer's weights (the
run stops past `--max-gap`). The held-out problems are answered greedily (temperature 0) before and after
training, with a paired bootstrap 95% interval of the difference. Writes `--out`/policy (an HF folder: model +
tokenizer, safetensors), reward_curve.png and history.json.

At the defaults SmolLM2-135M-Instruct goes from looping "#### 12" lines until the token limit cuts one to writing
"#### 12" and stopping; the held-out rewards, step times and sync cost are in bench/RESULTS.md ("GRPO through
final"), with the command that measured them.

`--tools` (examples/grpo_tools.py): the policy learns to use a calculator through final's multi-turn loop, on
arithmetic it cannot do in its head; each step also prints the share of its calls that were malformed, and
`--constrain-calls` rolls out with `rollout.multi_turn.constrain_tool_calls` (no malformed call by construction).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

import grpo_tools  # examples/ is the script's folder, first on sys.path

Reward = Callable[[str, str], float]
INSTRUCTION = ' Write the final answer on the last line as "#### <number>".'
NAMES, ITEMS = grpo_tools.NAMES, grpo_tools.ITEMS  # one list of each for both tasks' problems


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


def make_problem(rng: random.Random) -> Problem:
    """One word problem with a one-operation answer (sums up to 24, differences, products up to 25)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return Problem(f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
                       str(a + b))
    if kind == 1:
        a = rng.randint(5, 20)
        b = rng.randint(1, a - 1)
        return Problem(f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?",
                       str(a - b))
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    return Problem(f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in total?",
                   str(a * b))


def problem_sets(seed: int, held_out: int, make: Callable[[random.Random], Problem] = make_problem
                 ) -> tuple[list[Problem], Iterator[Problem]]:
    """The held-out problems (distinct, from seed + 1) and an endless stream of training problems (from seed)
    that never repeats a held-out question."""
    rng, held, seen = random.Random(seed + 1), [], set()
    while len(held) < held_out:
        p = make(rng)
        if p.question not in seen:
            seen.add(p.question)
            held.append(p)

    def train() -> Iterator[Problem]:
        rng = random.Random(seed)
        while True:
            p = make(rng)
            if p.question not in seen:
                yield p

    return held, train()


def gsm8k_reward(text: str, answer: str) -> float:
    """veRL's reward for data source openai/gsm8k: 1.0 when the last "#### N" line says the answer, else 0."""
    from verl.utils.reward_score import default_compute_score

    return float(default_compute_score("openai/gsm8k", text, answer))


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    from final.compat import chat_ids

    return chat_ids(tokenizer, [{"role": "user", "content": problem.question + INSTRUCTION}],
                    add_generation_prompt=True)


# ---- the policy's side ------------------------------------------------------------------------------------------
def group_logprobs(model, prompt: list[int], completions: list[list[int]],
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [n, L] of each completion's tokens after one shared prompt, under softmax(logits / temperature)
    (what the engine sampled from and reports), and the mask [n, L] of real tokens. The prompt runs once and its
    KV cache is repeated for the n completions, gradients flowing through it: exact, with a prompt's work done
    once per group instead of n times."""
    device = next(model.parameters()).device
    n, width = len(completions), max(len(c) for c in completions)
    ids = torch.zeros((n, width), dtype=torch.long, device=device)
    mask = torch.zeros((n, width), dtype=torch.bool, device=device)
    for i, c in enumerate(completions):
        ids[i, :len(c)] = torch.tensor(c, device=device)
        mask[i, :len(c)] = True
    decoder = model.base_model  # the transformer without its head (LlamaModel)
    first = decoder(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    hidden = first.last_hidden_state[:, -1:].expand(n, 1, -1)  # predicts each completion's first token
    if width > 1:
        cache = first.past_key_values
        cache.batch_repeat_interleave(n)
        attention = torch.cat([torch.ones((n, len(prompt)), dtype=torch.long, device=device),
                               mask[:, :-1].long()], dim=1)  # right padding: a row's real tokens never see it
        rest = decoder(input_ids=ids[:, :-1], past_key_values=cache, attention_mask=attention, use_cache=True)
        hidden = torch.cat([hidden, rest.last_hidden_state], dim=1)
    logits = model.get_output_embeddings()(hidden).float() / temperature
    logp = -torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
    return logp.view(n, width), mask


@dataclass
class Group:
    prompt: list[int]
    completions: list[list[int]]
    old_logprobs: list[list[float]] | None  # the engine's, per token (None: the policy's own before the step)
    rewards: list[float]
    masks: list[list[int]] | None = None  # 1 on the tokens the policy wrote (None: all; --tools: not tool results)

    def tokens(self) -> int:
        """The tokens that carry loss: the policy's own (masks), else every completion token."""
        return sum(map(sum, self.masks)) if self.masks is not None else sum(map(len, self.completions))

    def advantages(self) -> list[float]:
        r = np.asarray(self.rewards, dtype=np.float64)
        return ((r - r.mean()) / (r.std() + 1e-6)).tolist()


def padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def train_step(model, optimizer, groups: list[Group], args: argparse.Namespace, reference=None) -> dict:
    """One optimizer step on GRPO's clipped objective over the groups that carry signal; returns the step's
    diagnostics (gap: mean |policy - engine| log-prob of the sampled tokens before the step)."""
    live = [g for g in groups if max(g.rewards) > min(g.rewards)]
    tokens = sum(g.tokens() for g in live)
    gaps, loss_sum = [], 0.0
    for g in live:
        logp, mask = group_logprobs(model, g.prompt, g.completions, args.temperature)
        if g.masks is not None:
            mask = mask & padded(g.masks, logp).bool()
        old = padded(g.old_logprobs, logp) if g.old_logprobs is not None else logp.detach()
        adv = torch.tensor(g.advantages(), dtype=torch.float32, device=logp.device).unsqueeze(1)
        ratio = torch.exp(logp - old)
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
        if reference is not None and args.kl_coef > 0:  # k3 estimate of KL(policy || reference)
            with torch.no_grad():
                ref, _ = group_logprobs(reference, g.prompt, g.completions, args.temperature)
            log_r = ref - logp
            per_token = per_token + args.kl_coef * (torch.exp(log_r) - log_r - 1)
        loss = (per_token * mask).sum() / tokens
        loss.backward()
        loss_sum += float(loss.detach())
        if g.old_logprobs is not None:
            gaps.append((logp.detach() - old)[mask].abs())
    grad_norm = 0.0
    if live:  # no signal, no step: Adam's momentum alone would move the weights along an old gradient
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    gap = float(torch.cat(gaps).mean()) if gaps else float("nan")
    return {"loss": loss_sum, "grad_norm": grad_norm, "gap": gap, "live_groups": len(live), "stepped": bool(live)}


# ---- the engine's side ------------------------------------------------------------------------------------------
def open_engine(model_dir: str, args: argparse.Namespace):
    from final.inf import InferenceEngine

    if args.tools:
        return InferenceEngine(grpo_tools.engine_config(model_dir, args, Path(args.out)))
    return InferenceEngine({"model_path": model_dir, "progress": False, "rollout": {
        "name": "local", "dtype": args.engine_dtype, "prompt_length": 256, "response_length": args.max_tokens,
        "engine_kwargs": {"local": {"device": args.device}}}})


def rollout(engine, prompts: list[list[int]], problems: list[Problem], reward: Reward, args: argparse.Namespace,
            seed: int) -> tuple[list[Group], int, int, dict]:
    """n sampled completions per prompt, with the engine's logprobs; returns the groups, the policy version every
    row reports (checked to be one, and the engine's current one), the prompt tokens the engine did not compute
    (its prefix cache: a prompt's n samples share one prefill) and, with --tools, the calls' counts."""
    if args.tools:
        return rollout_tools(engine, problems, reward, args, seed)
    out = engine.generate(prompts, n=args.n, temperature=args.temperature, top_p=1.0, top_k=-1,
                          max_tokens=args.max_tokens, seed=seed, logprobs=True)
    versions = {m["weights_version"] for m in out.metadata}
    if versions != {engine.weights_version}:
        raise RuntimeError(f"rows report policy versions {versions}, the engine serves {engine.weights_version}")
    groups = []
    for p, (ids, problem) in enumerate(zip(prompts, problems)):
        rows = range(p * args.n, (p + 1) * args.n)  # prompt-major
        groups.append(Group(ids, [out.token_ids[i] for i in rows], [out.metadata[i]["logprobs"] for i in rows],
                            [reward(out.completions[i], problem.answer) for i in rows]))
    return groups, versions.pop(), sum(m["cached_tokens"] for m in out.metadata), {}


def rollout_tools(engine, problems: list[Problem], reward: Reward, args: argparse.Namespace,
                  seed: int) -> tuple[list[Group], int, int, dict]:
    """--tools: n conversations per problem through the multi-turn loop; a group's loss counts the tokens the policy
    wrote (response_mask), its old policy is the policy before the step."""
    rows, version = grpo_tools.rollout(engine, [p.question for p in problems], [p.answer for p in problems], reward,
                                       args, seed, args.n, args.temperature)
    groups = []
    for p in range(len(problems)):
        g = rows[p * args.n:(p + 1) * args.n]
        if any(r["prompt"] != g[0]["prompt"] for r in g):
            raise RuntimeError(f"problem {p}'s samples were rendered from different prompts")
        groups.append(Group(g[0]["prompt"], [r["response"] for r in g], None, [r["reward"] for r in g],
                            [r["mask"] for r in g]))
    return groups, version, sum(r["cached"] for r in rows), call_stats(rows)


def call_stats(rows: list[dict]) -> dict:
    calls = sum(r["calls"] for r in rows)
    return {"calls": calls, "malformed_calls": sum(r["malformed"] for r in rows),
            "rows_calling": sum(r["calls"] > 0 for r in rows) / len(rows),
            "turns": float(np.mean([r["turns"] for r in rows]))}


def evaluate(engine, tokenizer, problems: list[Problem], reward: Reward, args: argparse.Namespace) -> list[float]:
    """Greedy (temperature 0) answers to the held-out problems, one reward each."""
    if args.tools:
        rows, _ = grpo_tools.rollout(engine, [p.question for p in problems], [p.answer for p in problems], reward,
                                     args, 0, 1, 0.0)
        s = call_stats(rows)
        print(f"  held-out calls: {s['calls']} ({s['malformed_calls']} malformed), {s['rows_calling']:.0%} of "
              f"answers call the calculator, {s['turns']:.2f} assistant turns each", flush=True)
        return [r["correct"] for r in rows]
    out = engine.generate([prompt_ids(tokenizer, p) for p in problems], temperature=0, max_tokens=args.max_tokens)
    return [reward(text, p.answer) for text, p in zip(out.completions, problems)]


def bootstrap_diff(before: Sequence[float], after: Sequence[float], rounds: int = 10000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Mean of after - before over the same problems, and a paired bootstrap 95% interval of it."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    means = d[np.random.default_rng(seed).integers(0, len(d), (rounds, len(d)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi)


# ---- outputs ------------------------------------------------------------------------------------------------
def save_policy(model, tokenizer, folder: Path) -> Path:
    """An HF folder (safetensors) that `final generate --model FOLDER` and InferenceEngine load."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def plot(history: list[dict], before: float, after: float, file: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    rewards = [h["reward"] for h in history]
    window = max(1, len(rewards) // 8)
    smooth = [float(np.mean(rewards[max(0, i - window + 1):i + 1])) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, ".", alpha=0.5, label="train reward (sampled), per step")
    ax.plot(steps, smooth, "-", label=f"train reward, mean of last {window}")
    ax.axhline(before, color="grey", ls="--", label=f"held-out, before (greedy): {before:.3f}")
    ax.axhline(after, color="green", ls="--", label=f"held-out, after (greedy): {after:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("GRPO through final: reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(file, dpi=100)
    plt.close(fig)
    return file


# ---- the loop ---------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m-instruct", help="policy and engine (an HF folder too)")
    p.add_argument("--steps", type=int, default=30, help="rollout + optimizer steps (each step's update synced)")
    p.add_argument("--prompts", type=int, default=8, help="problems per step")
    p.add_argument("--n", type=int, default=8, help="completions per problem (a GRPO group)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per completion, rollouts and evaluation (None: 48; --tools: 160 per conversation, "
                        "tool results included)")
    p.add_argument("--temperature", type=float, default=0.6,
                   help="rollout sampling temperature (SmolLM2-135M's samples at 1.0 are mostly off-topic: ~0 reward)")
    p.add_argument("--lr", type=float, default=2e-5, help="Adam learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range of the ratio policy / engine")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the starting policy (0: no reference copy)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (total norm)")
    p.add_argument("--eval-problems", type=int, default=200, help="held-out problems, answered greedily")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the policy and the engine")
    p.add_argument("--engine-dtype", default="float32", help="the engine's dtype (float32: same numbers as the policy)")
    p.add_argument("--max-gap", type=float, default=None,
                   help="stop when the mean |policy - engine| logprob of the sampled tokens exceeds this: the engine "
                        "is not serving the trainer's weights (None: 0.01 with a float32 engine, where it is ~1e-6, "
                        "no check with another dtype, whose rounding alone gives 0.01-0.1; 0: no check)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's own, one per core)")
    p.add_argument("--seed", type=int, default=0, help="problems, sampling and the bootstrap")
    p.add_argument("--out", default="grpo_out", help="folder for policy/, reward_curve.png, history.json")
    p.add_argument("--tools", action="store_true",
                   help="the calculator task through the multi-turn loop (examples/grpo_tools.py)")
    p.add_argument("--constrain-calls", action="store_true",
                   help="--tools: rollouts under rollout.multi_turn.constrain_tool_calls (every call to the schema)")
    p.add_argument("--max-turns", type=int, default=3, help="--tools: assistant turns per conversation")
    p.add_argument("--call-bonus", type=float, default=0.2,
                   help="--tools: the reward of a wrong answer whose conversation ran the calculator (0: none)")
    args = p.parse_args(argv)
    if args.constrain_calls and not args.tools:
        p.error("--constrain-calls needs --tools")
    if args.max_tokens is None:
        args.max_tokens = 160 if args.tools else 48
    return args


def main(argv: Sequence[str] | None = None, reward: Reward = gsm8k_reward) -> dict:
    """Run the example; returns what it wrote (history, held-out rewards, paths). reward(text, answer) scores a
    completion (default: veRL's GSM8K scorer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from final.models import resolve_model_path

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    reference = None
    if args.kl_coef > 0:
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
        reference.requires_grad_(False)
    # fused: one kernel over all parameters; torch's default (foreach) step took 1.5-22 s on 2 cores, fused 0.1-0.5
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr, fused=True)
    make = (lambda rng: Problem(*grpo_tools.make_problem(rng))) if args.tools else make_problem
    held_out, train = problem_sets(args.seed, args.eval_problems, make)
    with open_engine(model_dir, args) as engine:
        before = evaluate(engine, tokenizer, held_out, reward, args)
        print(f"held-out reward before: {np.mean(before):.3f} ({len(held_out)} problems, greedy, "
              f"version {engine.weights_version})", flush=True)
        history = [run_step(step, engine, policy, optimizer, tokenizer, train, reward, args, reference)
                   for step in range(1, args.steps + 1)]
        after = evaluate(engine, tokenizer, held_out, reward, args)
        version = engine.weights_version
    diff, lo, hi = bootstrap_diff(before, after, seed=args.seed)
    print(f"held-out reward after: {np.mean(after):.3f} (version {version}); difference {diff:+.3f}, "
          f"95% bootstrap interval [{lo:+.3f}, {hi:+.3f}]", flush=True)
    policy_dir = save_policy(policy, tokenizer, out_dir / "policy")
    png = plot(history, float(np.mean(before)), float(np.mean(after)), out_dir / "reward_curve.png")
    wall = time.perf_counter() - started
    result = {"args": vars(args), "history": history, "held_out_before": before, "held_out_after": after,
              "difference": [diff, lo, hi], "wall_s": wall, "policy": str(policy_dir), "png": str(png)}
    (out_dir / "history.json").write_text(json.dumps(result, indent=1))
    cached = sum(h["cached_tokens"] for h in history)
    print(f"wrote {policy_dir}, {png}; wall time {wall:.0f} s; {cached} prompt tokens served from the engine's prefix "
          f"cache (a prompt's samples share one prefill)", flush=True)
    return result


def run_step(step: int, engine, policy, optimizer, tokenizer, train: Iterator[Problem], reward: Reward,
             args: argparse.Namespace, reference=None) -> dict:
    """Rollout through the engine, one optimizer step, the full weights into the engine; prints one line."""
    problems = [next(train) for _ in range(args.prompts)]
    prompts = [] if args.tools else [prompt_ids(tokenizer, p) for p in problems]  # --tools: the loop renders them
    t0 = time.perf_counter()
    groups, version, cached, calls = rollout(engine, prompts, problems, reward, args,
                                             seed=args.seed * 1_000_003 + step * args.prompts * args.n)
    t1 = time.perf_counter()
    stats = train_step(policy, optimizer, groups, args, reference)
    max_gap = args.max_gap if args.max_gap is not None else (1e-2 if args.engine_dtype == "float32" else 0)
    if max_gap and stats["gap"] > max_gap:
        raise RuntimeError(f"step {step}: the engine's logprobs differ from the policy's by {stats['gap']:.2e} on "
                           f"average (--max-gap {max_gap}): version {version} is not the trainer's weights")
    t2 = time.perf_counter()
    new_version = engine.update_weights(policy) if stats["stepped"] else version  # every optimizer step, whole
    t3 = time.perf_counter()
    rewards = [r for g in groups for r in g.rewards]
    tokens = [len(c) for g in groups for c in g.completions]
    row = {"step": step, "version": version, "reward": float(np.mean(rewards)), "gen_s": t1 - t0,
           "train_s": t2 - t1, "sync_ms": (t3 - t2) * 1e3 if stats["stepped"] else None, "new_version": new_version,
           "mean_tokens": float(np.mean(tokens)), "cached_tokens": cached, **stats, **calls}
    told = (f" | calls {calls['calls']}, malformed {calls['malformed_calls'] / max(calls['calls'], 1):.0%}"
            if calls else "")
    print(f"step {step:3d} | reward {row['reward']:.3f} | gen {row['gen_s']:5.1f} s | train {row['train_s']:5.1f} s"
          f" | sync {_ms(row['sync_ms'])} | version {version} | gap {row['gap']:.1e} | "
          f"groups {row['live_groups']}/{len(groups)} | tokens {row['mean_tokens']:.0f} | cached {cached}{told}",
          flush=True)
    return row


def _ms(value: float | None) -> str:
    return "no step " if value is None else f"{value:5.0f} ms"


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
