"""InferenceEngine.score and top-k logprobs on the embedded engine, checked against transformers itself: every
log-prob is HF's fp32 log_softmax of its own logits (within 1e-4), the alternatives are HF's top-k, and
is_greedy is HF's argmax check (lm-eval's loglikelihood)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import tiny_config
from final.errors import PromptError, SamplingError
from final.inf import InferenceEngine

ATOL = 1e-4


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T-1, V]: row j is log p(. | ids[:j+1]) from HF's forward, fp32 log_softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def check_against_hf(model, score, k: int) -> float:
    """Assert a Score equals HF's numbers; return the largest logprob difference."""
    ids = score.prompt_ids + score.continuation_ids
    ref = hf_logprobs(model, ids)
    got = (score.prompt_logprobs + score.continuation_logprobs)[1:]
    want = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    worst = (torch.tensor(got) - want).abs().max().item()
    assert worst < ATOL
    assert score.prompt_logprobs[0] is None
    scored = score.continuation_logprobs if score.continuation_ids else got
    assert score.logprob == pytest.approx(sum(scored), abs=1e-9)
    first = len(score.prompt_ids) - 1 if score.continuation_ids else 0  # the rows of ref that are scored
    greedy = ref[first:].argmax(dim=-1) == torch.tensor(ids[first + 1:])
    assert score.is_greedy == bool(greedy.all())
    if k:
        tops = (score.prompt_top_logprobs + score.continuation_top_logprobs)[1:]
        values, indices = ref.topk(k, dim=-1)
        for j, top in enumerate(tops):
            assert [t for t, _ in top] == indices[j].tolist()
            assert max(abs(lp - v) for (_, lp), v in zip(top, values[j].tolist())) < ATOL
    return worst


def test_scores_equal_hf_log_softmax(tiny_inference, hf_tiny):
    eng = tiny_inference
    prompts = ["The capital of France is", [1, 504, 3456, 28, 253, 99, 1000, 17], "Hello"]
    continuations = [" Paris, a city on the Seine.", [42, 7, 1999], None]
    scores = eng.score(prompts, continuations, top_logprobs=3, raw=True)
    assert [len(s.continuation_ids) for s in scores] == [len(eng.tokenizer(continuations[0],
                                                         add_special_tokens=False).input_ids), 3, 0]
    worst = max(check_against_hf(hf_tiny, s, 3) for s in scores)
    print(f"max |logprob - HF| on the tiny model: {worst:.2e}")
    # one prompt with its continuation as a bare string; k=0 keeps the alternatives to itself
    one = eng.score("The capital of France is", " Paris, a city on the Seine.", raw=True)
    assert one[0].logprob == pytest.approx(scores[0].logprob, abs=ATOL)
    assert one[0].prompt_top_logprobs is None and one[0].continuation_top_logprobs is None


def test_a_long_prompt_is_scored_in_chunks(hf_tiny):
    with InferenceEngine(tiny_config(prompt_length=700, response_length=8)) as eng:
        ids = torch.randint(3, 40000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
        score = eng.score([ids], top_logprobs=2)[0]  # 600 positions: three chunks of the runner's 256
        assert check_against_hf(hf_tiny, score, 2) < ATOL


def test_the_greedy_continuation_is_greedy(tiny_inference):
    prompt = "Once upon a time"
    out = tiny_inference.generate(prompt, raw=True, temperature=0, max_tokens=6, ignore_eos=True, top_logprobs=2)
    greedy = out.token_ids[0]
    [score] = tiny_inference.score(prompt, greedy, raw=True, top_logprobs=2)
    assert score.is_greedy and score.continuation_ids == greedy
    assert score.continuation_logprobs == pytest.approx(out.metadata[0]["logprobs"], abs=ATOL)
    [other] = tiny_inference.score(prompt, greedy[:-1] + [greedy[-1] + 1], raw=True)
    assert not other.is_greedy


def test_generate_returns_the_top_k(tiny_inference):
    out = tiny_inference.generate(["a b c", "d e"], temperature=0, max_tokens=5, top_logprobs=4)
    for m in out.metadata:
        assert len(m["top_logprobs"]) == len(m["response_ids"]) == len(m["logprobs"])  # top-k implies logprobs
        for tok, lp, top in zip(m["response_ids"], m["logprobs"], m["top_logprobs"]):
            assert len(top) == 4 and top[0] == (tok, lp)  # greedy: the chosen token is the most likely
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    sampled = tiny_inference.generate("a b c", temperature=1.0, seed=3, max_tokens=5, top_logprobs=2)
    m = sampled.metadata[0]
    assert all(lp <= top[0][1] + 1e-6 for lp, top in zip(m["logprobs"], m["top_logprobs"]))


def test_prompt_logprobs_while_generating(tiny_inference):
    out = tiny_inference.generate("x y z", raw=True, temperature=0, max_tokens=3, prompt_logprobs=True,
                                  top_logprobs=1)
    [score] = tiny_inference.score("x y z", raw=True, top_logprobs=1)
    m = out.metadata[0]
    assert m["prompt_logprobs"][0] is None and len(m["prompt_logprobs"]) == len(score.prompt_ids)
    assert m["prompt_logprobs"][1:] == pytest.approx(score.prompt_logprobs[1:], abs=ATOL)
    assert len(out.token_ids[0]) == 3
    nothing = tiny_inference.generate("x y z", raw=True, max_tokens=0, prompt_logprobs=True)
    assert nothing.completions == [""] and nothing.token_ids == [[]] and nothing.metadata[0]["completion_tokens"] == 0


def test_scores_after_a_cartridge_equal_the_document_in_the_prompt(tmp_path):
    from final.cartridges.build import build_from_text
    from final.cartridges.format import save_cartridge

    with InferenceEngine(tiny_config(prompt_length=256)) as eng:
        doc = eng.tokenizer("The lighthouse keeper of Orvanis is called Mara Quill.").input_ids
        save_cartridge(build_from_text(eng.engine, doc), tmp_path / "doc.pt")
        cid = eng.load_cartridge(path=str(tmp_path / "doc.pt"))
        question = eng.tokenizer(" Who keeps the lighthouse?", add_special_tokens=False).input_ids
        [with_cart] = eng.score([question], [" Mara Quill"], cartridge=cid, top_logprobs=2)
        [in_prompt] = eng.score([doc + question], [" Mara Quill"], top_logprobs=2)
        assert with_cart.cached_tokens == len(doc) and in_prompt.cached_tokens == 0
        assert with_cart.prompt_logprobs[0] is None  # the cartridge is KV: no logits before the first token
        after = len(doc) + 1
        assert with_cart.prompt_logprobs[1:] == pytest.approx(in_prompt.prompt_logprobs[after:], abs=ATOL)
        assert with_cart.continuation_logprobs == pytest.approx(in_prompt.continuation_logprobs, abs=ATOL)
        assert [[t for t, _ in top] for top in with_cart.continuation_top_logprobs] == \
            [[t for t, _ in top] for top in in_prompt.continuation_top_logprobs]
        assert with_cart.logprob == pytest.approx(in_prompt.logprob, abs=ATOL)


@pytest.mark.parametrize("args, kwargs, error, field", [
    (("hi", " there"), {"top_logprobs": 21}, SamplingError, "top_logprobs"),
    (("hi", " there"), {"top_logprobs": -1}, SamplingError, "top_logprobs"),
    (("hi", " there"), {"top_logprobs": "3"}, SamplingError, "top_logprobs"),
    ((["a", "b"], [" x"]), {}, PromptError, None),                      # one continuation per prompt
    (("hi", ""), {}, PromptError, None),                                 # an empty continuation
    (("hi", [10**7]), {}, PromptError, None),                            # outside the vocabulary
    (("hi", " word" * 40), {}, PromptError, None),                       # over rollout.response_length
    (("", " there"), {}, PromptError, None),
])
def test_bad_scoring_calls_are_typed_and_the_engine_keeps_serving(tiny_inference, args, kwargs, error, field):
    with pytest.raises(error) as exc:
        tiny_inference.score(*args, **kwargs)
    if field:
        assert exc.value.field == field
    assert tiny_inference.score("hi", " there")[0].logprob < 0


def test_generate_keywords_are_checked(tiny_inference):
    with pytest.raises(SamplingError, match="prompt_logprobs"):
        tiny_inference.generate("hi", max_tokens=0)
    with pytest.raises(SamplingError) as exc:
        tiny_inference.generate("hi", top_logprobs=99)
    assert exc.value.field == "top_logprobs"
    with pytest.raises(SamplingError) as exc:
        tiny_inference.generate("hi", prompt_logprobs="yes")
    assert exc.value.field == "prompt_logprobs"


def test_max_top_logprobs_is_configurable():
    cfg = tiny_config()
    cfg["limits"] = {"max_top_logprobs": 2}
    with InferenceEngine(cfg) as eng:
        assert len(eng.score("hi", " there", top_logprobs=2)[0].continuation_top_logprobs[0]) == 2
        with pytest.raises(SamplingError, match="limits.max_top_logprobs=2"):
            eng.score("hi", " there", top_logprobs=3)


def test_ascore_in_a_running_loop(tiny_inference):
    async def main():
        [a] = await tiny_inference.ascore("hi", " there", top_logprobs=1)
        [b] = tiny_inference.score("hi", " there", top_logprobs=1)  # blocking inside a loop: run on a side thread
        return a, b

    a, b = asyncio.run(main())
    assert a == b


def test_scoring_takes_the_batch_path_where_tools_are_on(tiny_inference):
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[1] / "tools.yaml")
    with InferenceEngine(tiny_config(multi_turn={"enable": True, "tool_config_path": tools})) as eng:
        [score] = eng.score("What is 2+2?", " 4")  # one forward pass, no tool loop: as on an engine without tools
        assert score == tiny_inference.score("What is 2+2?", " 4")[0]
        with pytest.raises(SamplingError, match="single-turn"):
            eng.generate("What is 2+2?", prompt_logprobs=True, max_tokens=2)


@pytest.mark.slow
def test_smollm2_scores_equal_hf(smol_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    cfg = {"model_path": "builtin:smollm2-135m-instruct", "progress": False,
           "rollout": {"name": "local", "prompt_length": 128, "response_length": 32}}
    with InferenceEngine(cfg) as eng:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = eng.generate(question, temperature=0, max_tokens=8)
        scores = eng.score([question, question], [answer.token_ids[0], " Berlin is the capital."], top_logprobs=5)
        worst = max(check_against_hf(hf, s, 5) for s in scores)
        print(f"max |logprob - HF| on SmolLM2-135M: {worst:.2e}")
        assert scores[0].is_greedy and not scores[1].is_greedy
        assert scores[0].logprob > scores[1].logprob
