"""The embedded engine's prefix cache (final/engine/prefix_cache.py): with it on, every row gives the tokens and
log-probs it gives with it off - a repeated prompt, a hit that ends inside a cached edge, the next turn of a
conversation whose answer was sampled, a prompt's n samples sharing one prefill, rows past the whole-step decode,
prompt logprobs, cartridges in front - on every dtype and decode path; and what it holds, frees and forgets."""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch
from engine_helpers import assert_same_or_tied, tokens_and_logprobs

from final.engine import EmbeddedEngine, kernels
from final.engine.prefix_cache import MIN_HIT

TINY_ARCHS = {"llama": "builtin:tiny-random-llama", "qwen3": "builtin:tiny-random-qwen3"}
needs_kernel = pytest.mark.skipif(kernels.gemv_kernel() is None, reason="the engine's kernel does not run here")
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(5, 2000, (n,), generator=g).tolist()


def run(engine: EmbeddedEngine, prompts, params=GREEDY, **kw) -> list[dict]:
    out = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2, **kw)
    return out if isinstance(out, list) else [out]


def scenario(engine: EmbeddedEngine) -> list[list[dict]]:
    """Requests in an order that makes the cache hit in every way it can; each step's outputs."""
    g = torch.Generator().manual_seed(0)
    base = ids(g, 80)
    steps = [run(engine, base + [1, 2, 3]), run(engine, base + [1, 2, 3])]  # a miss, then all but the last token
    steps.append(run(engine, base[:50] + [4, 5, 6, 7]))  # leaves a cached edge after 50 tokens: a split
    turn1 = run(engine, base + [9, 9], {"max_new_tokens": 6, "temperature": 0.9, "seed": 5})
    conversation = base + [9, 9] + turn1[0]["output_ids"] + [10, 11, 12]
    steps += [turn1, run(engine, conversation)]  # the next turn after a sampled answer
    steps.append(run(engine, conversation + [13], {"max_new_tokens": 5, "temperature": 0.8, "seed": 7, "n": 3}))
    steps.append(run(engine, base + [1, 2, 3], {"max_new_tokens": 2, "temperature": 0}, logprob_start_len=70))
    many = [base[:70] + [100 + i] * 2 for i in range(11)]  # past the 8 rows of the whole-step decode
    steps += [run(engine, many), run(engine, many)]
    return steps


def close(a: float, b: float) -> bool:
    """fp32: within 1e-5, relative to the log-prob where it is past 1 (the random model's tokens sit at -10; a
    turn's cached answer was computed by decode steps, the uncached one by a prefill: their K/V differ in the last
    bits, and its logits scale them)."""
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def engine_pair(path: str, **kw) -> tuple[EmbeddedEngine, EmbeddedEngine]:
    return EmbeddedEngine(path, **kw), EmbeddedEngine(path, prefix_cache=False, **kw)


def check_cached_tokens(steps: list[list[dict]]) -> None:
    cached = [[o["meta_info"]["cached_tokens"] for o in step] for step in steps]
    assert cached[0] == [0] and cached[1] == [82] and cached[2] == [50]
    assert cached[4][0] >= 82 + len(steps[3][0]["output_ids"]) - 1  # turn 1's prompt and answer (all but one)
    prompt = steps[5][0]["meta_info"]["prompt_tokens"]
    assert cached[5][1:] == [prompt, prompt]  # the other samples computed nothing of the prompt
    assert cached[6] == [70]  # stops where its prompt logprobs start
    assert all(c >= 70 for c in cached[8])


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
@pytest.mark.parametrize("kernel", ["1", "0"])
def test_cache_on_gives_what_cache_off_gives_fp32(monkeypatch, arch, kernel):
    """fp32, tokens equal and log-probs within 1e-5: the kernel's decode (segments by reference, final_attend for
    more than 8 rows and Qwen3's qk-norm) and torch's (the hit copied into the row's slot)."""
    if kernel == "1" and kernels.gemv_kernel() is None:
        pytest.skip("the engine's kernel does not run here")
    monkeypatch.setenv("FINAL_GEMV", kernel)
    from final.models import resolve_model_path

    on, off = engine_pair(resolve_model_path(TINY_ARCHS[arch]))
    try:
        assert on.core.scheduler.by_reference == (kernel == "1")
        got, want = scenario(on), scenario(off)
    finally:
        on.shutdown()
        off.shutdown()
    for a, b in zip(got, want):
        for (ids_a, lps_a), (ids_b, lps_b) in zip(tokens_and_logprobs(a), tokens_and_logprobs(b)):
            assert ids_a == ids_b and all(close(x, y) for x, y in zip(lps_a, lps_b))
        for x, y in zip(a, b):
            inputs = [(lp, t) for lp, t, _ in x["meta_info"]["input_token_logprobs"]]
            theirs = [(lp, t) for lp, t, _ in y["meta_info"]["input_token_logprobs"]]
            assert [t for _, t in inputs] == [t for _, t in theirs]
            assert all(p == q or close(p, q) for (p, _), (q, _) in zip(inputs, theirs))
    check_cached_tokens(got)
    assert all(o["meta_info"]["cached_tokens"] == 0 for step in want for o in step)


# bf16 activations: the same prompt alone and in a batch of three already differ by 0.06 on the tiny model (bf16
# rounds differently with the batch's shape), HF's full forward and our decode by 0.07 on SmolLM2's conversation
# below, and a hit swaps a prefill's K/V for the decode's; int8 / bf16 weights: the kernel's 1e-3 (test_engine_gemv)
BF16_TOL = 0.2


@pytest.mark.parametrize("mode,tol", [("bf16-dtype", BF16_TOL), ("int8", 1e-3), ("bf16-weights", 1e-3)])
def test_cache_on_gives_what_cache_off_gives_bf16_and_int8(tiny_dir, mode, tol):
    """bf16 activations (hits copied into slots) and the kernel's int8 / bf16 weights: the same tokens, log-probs
    within each mode's own rounding (a step where the top two tie within it may go either way)."""
    if mode != "bf16-dtype" and kernels.gemv_kernel() is None:
        pytest.skip("int8 and bf16 weights run on the engine's kernel")
    kw = {"dtype": "bfloat16"} if mode == "bf16-dtype" else {"quantization": mode.split("-")[0]}
    on, off = engine_pair(tiny_dir, **kw)
    try:
        got, want = scenario(on), scenario(off)
    finally:
        on.shutdown()
        off.shutdown()
    for a, b in zip(got, want):
        assert_same_or_tied(a, b, tol)
    check_cached_tokens(got)


@needs_kernel
def test_a_cached_prefix_after_a_cartridge(tiny_dir):
    """A cartridge in front: the cache's tree is the cartridge's (its positions and K/V are in the key), a row
    attends to the cartridge and its cached nodes in one softmax, and an unloaded-then-reloaded id is another
    prefix (nothing cached behind the old load is served)."""
    g = torch.Generator().manual_seed(3)
    on, off = engine_pair(tiny_dir)
    try:
        cart_ids = ids(g, 40)
        _, kv = on.call(lambda r: r.forward_full(cart_ids, None, capture=True))
        for engine in (on, off):
            engine.load_cartridge("doc", [k for k, _ in kv], [v for _, v in kv])
        q = ids(g, 30)
        results = []
        for engine in (on, off):
            first = run(engine, q + [1, 2], cartridges=("doc",))
            again = run(engine, q + [1, 2, 3], cartridges=("doc",))
            bare = run(engine, q + [1, 2, 3])  # the same tokens without the cartridge: another tree
            results.append((first, again, bare))
        for a, b in zip(results[0], results[1]):
            assert tokens_and_logprobs(a)[0][0] == tokens_and_logprobs(b)[0][0]
            assert max(abs(x - y) for x, y in zip(tokens_and_logprobs(a)[0][1], tokens_and_logprobs(b)[0][1])) < 1e-5
        first, again, bare = results[0]
        assert first[0]["meta_info"]["cached_tokens"] == 40
        assert again[0]["meta_info"]["cached_tokens"] == 40 + 32
        assert bare[0]["meta_info"]["cached_tokens"] == 0
        other = [t + 0.5 for t, _ in kv], [v - 0.5 for _, v in kv]
        on.unload_cartridge("doc")
        on.load_cartridge("doc", *other)
        off.unload_cartridge("doc")
        off.load_cartridge("doc", *other)
        after = run(on, q + [1, 2, 3], cartridges=("doc",))
        assert after[0]["meta_info"]["cached_tokens"] == 40  # the old load's continuations are gone
        assert tokens_and_logprobs(after) == tokens_and_logprobs(run(off, q + [1, 2, 3], cartridges=("doc",)))
    finally:
        on.shutdown()
        off.shutdown()


def test_flush_update_and_release_empty_the_cache(tiny_dir):
    engine = EmbeddedEngine(tiny_dir)
    g = torch.Generator().manual_seed(4)
    prompt = ids(g, 40)
    try:
        cached = lambda: run(engine, prompt)[0]["meta_info"]["cached_tokens"]  # noqa: E731
        assert cached() == 0 and cached() == 39
        assert engine.flush_cache() and engine.core.prefix_cache.tokens == 0
        assert cached() == 0 and cached() == 39
        named = [(n, torch.zeros(s)) for n, s in engine.parameter_shapes().items() if "norm" in n][:1]
        version = engine.update_weights(named)
        assert engine.core.prefix_cache.tokens == 0 and cached() == 0
        assert run(engine, prompt)[0]["meta_info"]["weight_version"] == version
        engine.release_memory_occupation()
        assert engine.core.prefix_cache.tokens == 0 and engine.core.cache.nbytes == 0
        assert cached() == 0 and cached() == 39
    finally:
        engine.shutdown()
    assert engine.flush_cache()  # after shutdown: nothing to flush, no error


@pytest.mark.slow
def test_the_cache_stays_under_its_budget_and_evicts_the_least_recently_used(smol_dir):
    """Distinct prompts past the budget: the cache never holds more than it, evicts what was used longest ago, and
    the process does not grow by what it let go (RSS)."""
    budget = 8 << 20  # 180 tokens of SmolLM2's fp32 K/V
    engine = EmbeddedEngine(smol_dir, prefix_cache_bytes=budget, max_model_len=512)
    g = torch.Generator().manual_seed(6)
    prompts = [ids(g, 100) for _ in range(16)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        cache = engine.core.prefix_cache
        engine.generate(prompts[0], params)  # the row pool's first allocation
        start = rss_bytes()
        for prompt in prompts[1:]:
            engine.generate(prompt, params)
            assert engine.call(lambda _r: cache.nbytes) <= budget
        assert cache.stats.evicted_tokens >= 13 * 103
        assert rss_bytes() - start < budget + (32 << 20)  # without eviction: 15 x 103 tokens = 71 MB
        kept = engine.generate(prompts[-1], params)["meta_info"]["cached_tokens"]
        lost = engine.generate(prompts[1], params)["meta_info"]["cached_tokens"]
        assert kept == 99 and lost == 0
    finally:
        engine.shutdown()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_threads_at_once_get_what_they_get_alone(tiny_dir):
    """Eight callers on their own threads, prompts sharing prefixes and each other's answers (the engine thread
    owns the cache): each gets what the engine without a cache gives it alone."""
    g = torch.Generator().manual_seed(8)
    system = ids(g, 60)
    prompts = [system + ids(g, 10) for _ in range(8)]
    on, off = engine_pair(tiny_dir)
    try:
        want = [tokens_and_logprobs(run(off, p)) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                got = list(pool.map(lambda p: tokens_and_logprobs(run(on, p)), prompts))
                for (a_ids, a_lps), (b_ids, b_lps) in zip((x[0] for x in got), (y[0] for y in want)):
                    assert a_ids == b_ids and all(close(x, y) for x, y in zip(a_lps, b_lps))
        assert on.core.prefix_cache.stats.hit_tokens >= 16 * len(system)
    finally:
        on.shutdown()
        off.shutdown()


def test_short_hits_are_not_taken(tiny_engine):
    g = torch.Generator().manual_seed(9)
    head = ids(g, MIN_HIT - 1)
    run(tiny_engine, head + ids(g, 20))
    assert run(tiny_engine, head + ids(g, 20))[0]["meta_info"]["cached_tokens"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp32", "int8", "bf16-dtype"])
def test_a_conversation_on_smollm2_continues_from_its_cache(smol_dir, mode):
    """SmolLM2: a chat whose turns are sampled (seeded) and greedy, each turn's prompt the rendered history; with
    the cache every turn after the first prefills only what is new, and gives what the engine without it gives
    (fp32: log-probs within 1e-5 of their size, 1.4e-5 at most seen, at a -5.4 token of the last sampled turn;
    int8 and bf16 within their own rounding, as the tiny model's test)."""
    from transformers import AutoTokenizer

    from final.compat import chat_ids

    if mode == "int8" and kernels.gemv_kernel() is None:
        pytest.skip("int8 runs on the engine's kernel")
    kw = {"fp32": {}, "int8": {"quantization": "int8"}, "bf16-dtype": {"dtype": "bfloat16"}}[mode]
    tok = AutoTokenizer.from_pretrained(smol_dir)
    on, off = engine_pair(smol_dir, max_model_len=1024, **kw)
    messages = [{"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}]
    try:
        for turn, (question, params) in enumerate([
                ("Name a large city in France.", {"max_new_tokens": 16, "temperature": 0.7, "seed": 3}),
                ("Which river runs through it?", {"max_new_tokens": 16, "temperature": 0}),
                ("And one famous building there?", {"max_new_tokens": 16, "temperature": 0.7, "seed": 4})]):
            messages.append({"role": "user", "content": question})
            prompt = chat_ids(tok, messages, add_generation_prompt=True)
            a, b = run(on, prompt, params)[0], run(off, prompt, params)[0]
            (ids_a, lps_a), (ids_b, lps_b) = tokens_and_logprobs([a])[0], tokens_and_logprobs([b])[0]
            if mode == "fp32":
                assert ids_a == ids_b and all(close(x, y) for x, y in zip(lps_a, lps_b))
            elif params["temperature"] == 0:
                assert_same_or_tied([a], [b], 1e-3 if mode == "int8" else BF16_TOL)
            else:  # a sampled turn: its first position's distribution (the prefill's) within that rounding
                top_a, top_b = a["meta_info"]["output_top_logprobs"][0], b["meta_info"]["output_top_logprobs"][0]
                assert abs(top_a[0][0] - top_b[0][0]) <= (1e-3 if mode == "int8" else BF16_TOL)
            if turn:
                assert a["meta_info"]["cached_tokens"] >= len(prompt) - len(chat_ids(tok, messages[-1:])) - 8
            messages.append({"role": "assistant", "content": tok.decode(ids_a, skip_special_tokens=True)})
    finally:
        on.shutdown()
        off.shutdown()


def test_final_serve_reports_cached_tokens_to_concurrent_clients():
    """OpenAI clients at once on `final serve`: usage.prompt_tokens_details.cached_tokens counts the system
    prompt they share once it is cached, and each gets the answer it gets alone."""
    import openai
    from serve_helpers import start_served, stop_served

    served = start_served()
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        system = "You are a careful assistant who answers questions about cooking. " * 4

        def ask(question: str):
            return client.chat.completions.create(model="default", max_tokens=6, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])

        first = ask("How long do I boil an egg?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        questions = [f"Question {i}: how much salt goes in {i} litres of pasta water?" for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, questions))
        shared = len(served.inference.tokenizer(system)["input_ids"])
        assert all(o.usage.prompt_tokens_details.cached_tokens >= shared for o in together)
        alone = [ask(q) for q in questions]  # now their own prompts are cached too
        assert [o.choices[0].message.content for o in alone] == [o.choices[0].message.content for o in together]
        assert all(o.usage.prompt_tokens_details.cached_tokens >= o.usage.prompt_tokens - 1 for o in alone)
    finally:
        stop_served(served)


def test_a_tool_loop_call_leaves_its_conversation_for_the_next_call(tmp_path):
    """InferenceEngine with tools (the multi-turn rollout): a conversation that goes on in the next call finds its
    history cached. veRL flushes after every multi-turn call; the local backend does not (its weight updates
    empty the cache themselves: LocalRollout.flush_after_multi_turn)."""
    from pathlib import Path

    from multiturn_helpers import make_tool_model

    from final.inf import InferenceEngine
    from final.models import resolve_model_path

    tools = Path(__file__).resolve().parents[1] / "tools.yaml"
    model = make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path / "m")
    config = {"model_path": model, "progress": False,
              "rollout": {"name": "local", "prompt_length": 512, "response_length": 12,
                          "multi_turn": {"enable": True, "tool_config_path": str(tools)}}}
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    with InferenceEngine(config) as engine:
        chat = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many?"}]
        first = engine.generate([chat], tools_kwargs=kwargs, temperature=0)
        chat += [{"role": "assistant", "content": first.completions[0]}, {"role": "user", "content": "And in June?"}]
        second = engine.generate([chat], tools_kwargs=kwargs, temperature=0)
        assert first.metadata[0]["cached_tokens"] == 0
        assert second.metadata[0]["cached_tokens"] >= first.metadata[0]["prompt_tokens"] - 1
