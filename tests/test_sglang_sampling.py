"""One meaning per sampling key: each key the lane's SGLang backend accepts does what it does on the embedded engine
(the real SGLang engine on CPU beside the local backend, greedy, token for token), and a key SGLang would take and
not serve that way is refused with a typed error naming it and why:
- the penalties (presence, frequency, repetition) under SGLang's overlap scheduler, its default, which counts the
  generated tokens one step late (and the prompt's last token): with disable_overlap_schedule they are exact;
- SGLang 0.5.2 (veRL 0.6.0's lane, this module): repetition_penalty, which it accepts and never applies, and
  min_new_tokens, whose penalizer kills its scheduler under veRL's skip_tokenizer_init.
SGLang 0.5.12 (veRL 0.9.1's lane) serves both: tests/sglang_direct_sampling_cases.py runs these cases there.

Greedy rows are compared because SGLang draws its samples differently; keys that only shape sampling (top_k,
min_p) are compared where they decide the token alone (top_k=1, min_p=1 keep only the most likely token).
"""

from __future__ import annotations

import pytest

from final import compat
from sglang_helpers import CPU_ARGS, TINY, use_sglang_cpu
from final.errors import ConfigError, UnsupportedError

PROMPTS = ["Count to three.", "Name a color.", "Hi", [1, 504, 3456, 28, 253]]
LANE_052 = compat.LANE != "verl09"
EXACT = {"disable_overlap_schedule": True}  # the penalties count every generated token as it is made


def sampling_config(name: str, sglang_args: dict | None = None, **rollout) -> dict:
    engine_kwargs = {"sglang": {**CPU_ARGS, **(sglang_args or {})}} if name == "sglang" else {}
    return {"model_path": TINY, "progress": False, "rollout": {
        "name": name, "dtype": "float32", "prompt_length": 64, "response_length": 16, "calculate_log_probs": False,
        "engine_kwargs": engine_kwargs, **rollout}}


def engine_pair():
    """A module fixture's body: (the lane's SGLang backend without the overlap scheduler, the embedded engine)."""
    use_sglang_cpu()
    from final.inf import InferenceEngine

    with InferenceEngine(sampling_config("sglang", EXACT)) as sglang, InferenceEngine(sampling_config("local")) as local:
        yield sglang, local


@pytest.fixture(scope="module")
def engines():
    if not LANE_052:
        pytest.skip("the verl09 lane runs these cases in tests/sglang_direct_sampling_cases.py")
    yield from engine_pair()


def same(engines, prompts=PROMPTS, **sampling) -> list[list[int]]:
    sglang, local = engines
    a = sglang.generate(prompts, max_tokens=12, **sampling)
    b = local.generate(prompts, max_tokens=12, **sampling)
    assert a.token_ids == b.token_ids, sampling
    assert [m["finish_reason"] for m in a.metadata] == [m["finish_reason"] for m in b.metadata], sampling
    return a.token_ids


def test_penalties_mean_the_same_on_both_engines(engines):
    plain = same(engines, temperature=0, ignore_eos=True)
    for penalties in ({"presence_penalty": 1.5}, {"frequency_penalty": -2.0}):
        same(engines, temperature=0, ignore_eos=True, **penalties)
    # negative penalties favour what was generated: the random model then repeats itself (the check is not vacuous)
    assert same(engines, temperature=0, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0) != plain


def test_repetition_penalty_is_applied_over_the_output_or_refused(engines):
    sglang, _ = engines
    if LANE_052:  # SGLang 0.5.2 accepts it and applies nothing: refused before any work, the engine serving on
        with pytest.raises(UnsupportedError, match="never applies it") as err:
            sglang.generate(PROMPTS, temperature=0, max_tokens=4, repetition_penalty=1.3)
        assert (err.value.backend, err.value.field) == ("sglang", "repetition_penalty")
        assert sglang.generate(PROMPTS, temperature=0, max_tokens=4, repetition_penalty=1.0).completions
        return
    plain = same(engines, temperature=0, ignore_eos=True)
    same(engines, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    assert same(engines, temperature=0, ignore_eos=True, repetition_penalty=0.5) != plain


def test_min_new_tokens_stop_ids_and_stop_strings_end_rows_alike(engines):
    sglang, local = engines
    first = local.generate(PROMPTS, temperature=0, max_tokens=12, ignore_eos=True).token_ids
    stop = first[0][1]  # row 0's second token: without min_new_tokens the row stops there
    assert len(same(engines, temperature=0, stop_token_ids=[stop])[0]) == 2
    text = local.tokenizer.decode(first[1][3:5])
    if text.strip():
        same(engines, temperature=0, stop=[text], ignore_eos=True)
    if LANE_052:  # its min-new-tokens penalizer reads the request's tokenizer, None under skip_tokenizer_init
        with pytest.raises(UnsupportedError, match="scheduler dies") as err:
            sglang.generate(PROMPTS, temperature=0, max_tokens=8, stop_token_ids=[stop], min_new_tokens=6)
        assert err.value.field == "min_new_tokens"
        assert sglang.generate(PROMPTS, temperature=0, max_tokens=4).completions  # still serving
        return
    held = same(engines, temperature=0, stop_token_ids=[stop], min_new_tokens=6)
    assert len(held[0]) >= 6 and stop not in held[0][:5]  # the stop id was blocked until 6 tokens were out


def test_top_k_and_min_p_keep_only_the_most_likely_token_when_tight(engines):
    greedy = same(engines, temperature=0, ignore_eos=True)
    for sampling in ({"top_k": 1}, {"min_p": 1.0}):
        for eng in engines:
            assert eng.generate(PROMPTS, max_tokens=12, temperature=1.0, ignore_eos=True, **sampling).token_ids == \
                greedy, (eng.backend, sampling)


def test_under_the_overlap_scheduler_penalties_are_refused_naming_why():
    """SGLang's default: refused per request (the backend's capabilities) and as a config default (at start, before
    SGLang is imported); veRL's no-op values pass."""
    from final.rollout import backend_class
    from final.rollout.sglang.config import UNSERVED_BY_052, check_applied_defaults, refusing, unserved_keys
    from final.sampling import parse_sampling

    lane = UNSERVED_BY_052 if LANE_052 else None
    capabilities = refusing(backend_class("sglang").capabilities, unserved_keys(None, lane))
    for key, value in (("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("repetition_penalty", 1.2)):
        with pytest.raises(UnsupportedError, match="one step late" if key != "repetition_penalty" or not LANE_052
                           else "never applies it") as err:
            capabilities.check("sglang", parse_sampling({key: value}, response_length=16))
        assert err.value.field == key
    capabilities.check("sglang", parse_sampling({"presence_penalty": 0.0, "repetition_penalty": 1.0},
                                                response_length=16))
    exact = refusing(backend_class("sglang").capabilities, unserved_keys({"sglang": EXACT}, lane))
    exact.check("sglang", parse_sampling({"presence_penalty": 0.5}, response_length=16))
    # a config default goes into every request: veRL 0.9.1's RolloutConfig has repetition_penalty (0.6.0's none)
    with pytest.raises(ConfigError, match="one step late") as err:
        check_applied_defaults({"repetition_penalty": 1.2}, unserved_keys(None))
    assert err.value.key == "rollout.repetition_penalty"
    check_applied_defaults({"repetition_penalty": 1.0, "presence_penalty": 0.0}, unserved_keys(None, lane))
    if not LANE_052:  # InferenceEngine refuses it at start, before SGLang starts
        use_sglang_cpu()
        from final.inf import InferenceEngine

        with pytest.raises(ConfigError, match="one step late") as err:
            InferenceEngine(sampling_config("sglang", repetition_penalty=1.2))
        assert err.value.key == "rollout.repetition_penalty"
