"""Scoring and top-k logprobs on the real SGLang 0.5.2 engine (CPU, tests/sglang_cpu) equal the embedded engine's:
SGLang computes them with its own return_logprob / logprob_start_len / top_logprobs_num, reached through the engine
wrapper under veRL's batch call. One SGLang engine serves the module."""

from __future__ import annotations

import pytest

from sglang_helpers import CPU_ARGS, TINY, use_sglang_cpu

ATOL = 1e-4
PROMPTS = ["The capital of France is", [1, 504, 3456, 28, 253, 99, 1000, 17], "Hello"]
CONTINUATIONS = [" Paris, a city on the Seine.", [42, 7, 1999], None]


def config(name: str, **engine_kwargs) -> dict:
    return {"model_path": TINY, "progress": False, "rollout": {
        "name": name, "dtype": "float32", "prompt_length": 128, "response_length": 16,
        "engine_kwargs": {name: engine_kwargs}}}


@pytest.fixture(scope="module")
def pair():
    use_sglang_cpu()
    from final.inf import InferenceEngine

    with InferenceEngine(config("sglang", **CPU_ARGS)) as sglang, InferenceEngine(config("local")) as local:
        yield sglang, local


def same_scores(a, b) -> None:
    assert a.prompt_ids == b.prompt_ids and a.continuation_ids == b.continuation_ids
    assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
    assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=ATOL)
    assert a.continuation_logprobs == pytest.approx(b.continuation_logprobs, abs=ATOL)
    assert a.logprob == pytest.approx(b.logprob, abs=ATOL) and a.is_greedy == b.is_greedy
    for x, y in ((a.prompt_top_logprobs[1:], b.prompt_top_logprobs[1:]),
                 (a.continuation_top_logprobs, b.continuation_top_logprobs)):
        assert [[t for t, _ in top] for top in x] == [[t for t, _ in top] for top in y]
        assert [v for top in x for _, v in top] == pytest.approx([v for top in y for _, v in top], abs=ATOL)


def test_scores_equal_the_embedded_engine(pair):
    sglang, local = pair
    for a, b in zip(sglang.score(PROMPTS, CONTINUATIONS, top_logprobs=3, raw=True),
                    local.score(PROMPTS, CONTINUATIONS, top_logprobs=3, raw=True)):
        same_scores(a, b)
    # the greedy continuation is greedy on both
    greedy = local.generate("Once upon a time", raw=True, temperature=0, max_tokens=5, ignore_eos=True).token_ids[0]
    [a] = sglang.score("Once upon a time", greedy, raw=True)
    assert a.is_greedy and a.continuation_top_logprobs is None


def test_top_k_and_prompt_logprobs_while_generating(pair):
    sglang, local = pair
    kw = dict(raw=True, temperature=0, max_tokens=4, top_logprobs=2, prompt_logprobs=True)
    a, b = sglang.generate(PROMPTS[:2], **kw), local.generate(PROMPTS[:2], **kw)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.metadata, b.metadata):
        assert [[t for t, _ in top] for top in x["top_logprobs"]] == [[t for t, _ in top] for top in y["top_logprobs"]]
        assert x["logprobs"] == pytest.approx(y["logprobs"], abs=ATOL)
        assert x["prompt_logprobs"][1:] == pytest.approx(y["prompt_logprobs"][1:], abs=ATOL)
    # max_tokens 0: SGLang makes a token anyway; it is dropped
    nothing = sglang.generate(PROMPTS[:1], raw=True, max_tokens=0, prompt_logprobs=True)
    assert nothing.token_ids == [[]] and nothing.metadata[0]["completion_tokens"] == 0
    assert sglang.generate("hi", max_tokens=3, temperature=0).completions  # plain calls unchanged afterwards


def test_scores_after_a_cartridge(pair, tmp_path):
    from final.cartridges.build import build_from_text
    from final.cartridges.format import save_cartridge

    sglang, local = pair
    doc = local.tokenizer("The lighthouse keeper of Orvanis is called Mara Quill.").input_ids
    save_cartridge(build_from_text(local.engine, doc), tmp_path / "doc.pt")
    question = local.tokenizer(" Who keeps the lighthouse?", add_special_tokens=False).input_ids
    scores = []
    for eng in (sglang, local):
        cid = eng.load_cartridge(id="doc", path=str(tmp_path / "doc.pt"))
        scores.append(eng.score([question], [" Mara Quill"], cartridge=cid, top_logprobs=2)[0])
        eng.unload_cartridge(cid)
    same_scores(*scores)
    assert scores[0].cached_tokens >= len(doc)  # SGLang served the cartridge from its radix cache


def test_bad_calls_are_refused_before_sglang_sees_them(pair):
    from final.errors import PromptError, SamplingError

    sglang, _ = pair
    with pytest.raises(SamplingError):
        sglang.score("hi", " there", top_logprobs=21)
    with pytest.raises(PromptError):
        sglang.score("hi", [10**7])
    assert sglang.score("hi", " there")[0].logprob < 0
