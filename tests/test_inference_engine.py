"""InferenceEngine end to end: prompt shapes, sampling kwargs, bad input, event loops, lifecycle."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import tiny_config
from final.compat import chat_ids
from final.errors import ConfigError, EngineError, ModelError, PromptError, SamplingError
from final.inf import GenerationOutput, InferenceEngine


def test_prompt_shapes(tiny_inference):
    eng = tiny_inference
    one = eng.generate("hello there", temperature=0, max_tokens=5)
    assert isinstance(one, GenerationOutput) and len(one.completions) == 1 and len(one.token_ids[0]) == 5
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    batch = eng.generate(["hello there", conv, [[{"role": "user", "content": "hello there"}]][0]],
                         temperature=0, max_tokens=5)
    assert len(batch.completions) == 3
    assert batch.token_ids[0] == one.token_ids[0] == batch.token_ids[2]  # same chat, same greedy tokens
    ids = chat_ids(eng.tokenizer, [{"role": "user", "content": "hello there"}], add_generation_prompt=True)
    assert eng.generate(ids, temperature=0, max_tokens=5).token_ids[0] == one.token_ids[0]
    raw = eng.generate("hello there", raw=True, temperature=0, max_tokens=5)
    assert raw.metadata[0]["prompt_tokens"] < one.metadata[0]["prompt_tokens"]  # no chat template


def test_metadata_and_n_grouping(tiny_inference):
    out = tiny_inference.generate(["a b c", "d e"], n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=True)
    assert len(out.completions) == 6 and out.n == 3 and len(out.grouped()) == 2
    assert [m["prompt_index"] for m in out.metadata] == [0, 0, 0, 1, 1, 1]
    m = out.metadata[0]
    assert set(m) >= {"response_ids", "response_mask", "finish_reason", "prompt_tokens", "completion_tokens",
                      "logprobs"}
    assert len(m["logprobs"]) == len(m["response_ids"]) == m["completion_tokens"] <= 6
    again = tiny_inference.generate(["a b c", "d e"], n=3, temperature=1.0, seed=5, max_tokens=6)
    assert again.token_ids == out.token_ids  # seeded: reproducible
    assert len({tuple(t) for t in out.token_ids[:3]}) > 1  # the n samples differ


def test_greedy_via_do_sample_or_temperature_zero(tiny_inference):
    a = tiny_inference.generate("x y z", do_sample=False, temperature=0.9, max_tokens=6).token_ids
    b = tiny_inference.generate("x y z", temperature=0, max_tokens=6).token_ids
    assert a == b


@pytest.mark.parametrize("prompts, kwargs, error", [
    ([], {}, PromptError), ("", {}, PromptError), ("   ", {}, PromptError),
    ([{"content": "hi"}], {}, PromptError), ([{"role": "user"}], {}, PromptError),
    ([{"role": "wizard", "content": "hi"}], {}, PromptError), ("word " * 200, {}, PromptError),
    ("hi", {"max_tokens": 0}, SamplingError), ("hi", {"max_tokens": 999}, SamplingError),
    ("hi", {"temperature": -0.5}, SamplingError), ("hi", {"top_p": 0.0}, SamplingError),
    ("hi", {"top_p": 1.5}, SamplingError), ("hi", {"top_k": 0}, SamplingError), ("hi", {"n": 0}, SamplingError),
    ("hi", {"tempreature": 1}, SamplingError), (42, {}, PromptError),
])
def test_bad_input_is_typed_and_engine_keeps_serving(tiny_inference, prompts, kwargs, error):
    with pytest.raises(error):
        tiny_inference.generate(prompts, **kwargs)
    assert len(tiny_inference.generate("still alive", max_tokens=3, temperature=0).token_ids[0]) == 3


def test_prompt_error_names_the_index(tiny_inference):
    with pytest.raises(PromptError) as err:
        tiny_inference.generate(["fine", [{"role": "user", "content": "ok"}, {"role": "bot", "content": "x"}]])
    assert err.value.index == 1 and "message 1" in str(err.value)


def test_agenerate_inside_a_running_loop_and_from_threads(tiny_inference):
    async def cell():  # what a Jupyter cell does: the loop is already running
        outs = await asyncio.gather(*(tiny_inference.agenerate(f"q{i}", temperature=0, max_tokens=4)
                                      for i in range(3)))
        return [o.token_ids[0] for o in outs]

    in_loop = asyncio.run(cell())
    results = {}

    def worker(i):
        results[i] = tiny_inference.generate(f"q{i}", temperature=0, max_tokens=4).token_ids[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == in_loop


def test_lifecycle_second_engine_after_shutdown():
    with InferenceEngine(tiny_config()) as first:
        a = first.generate("hello", temperature=0, max_tokens=4).token_ids
    with pytest.raises(EngineError):
        first.generate("hello")
    second = InferenceEngine(tiny_config())
    try:
        assert second.generate("hello", temperature=0, max_tokens=4).token_ids == a
    finally:
        second.shutdown()
        second.shutdown()  # idempotent


def test_construction_errors():
    with pytest.raises(ModelError):
        InferenceEngine({"model_path": "/no/such/model"})
    with pytest.raises(ConfigError):
        InferenceEngine(tiny_config(prompt_length=5000))
    with InferenceEngine(tiny_config(calculate_log_probs=False)) as eng:  # the engine's record has them anyway
        meta = eng.generate("hi", logprobs=True, max_tokens=3).metadata[0]
        assert len(meta["logprobs"]) == meta["completion_tokens"] == 3
        assert "rollout_log_probs" not in eng.rollout.generate_sequences(eng.prepare("hi").dataproto(
            eng.pad_token_id, eng.eos_token_ids, None)).batch.keys()  # veRL's own switch still holds


def test_smollm2_answers_paris():
    with InferenceEngine("config.yaml") as eng:
        out = eng.generate("What is the capital of France?", temperature=0)
    assert "Paris" in out.completions[0]
    assert out.metadata[0]["finish_reason"] == "stop"


def test_progress_bar_on_large_batches_and_off_switch(tiny_inference, capsys):
    tiny_inference.generate(["hi"] * 32, max_tokens=2, progress=True)
    err = capsys.readouterr().err
    assert "generate" in err and "32/32" in err  # one tick per finished row
    tiny_inference.generate(["hi"] * 32, max_tokens=2, progress=False)
    tiny_inference.generate(["hi"] * 4, max_tokens=2, progress=True)  # small batches stay quiet
    assert "generate" not in capsys.readouterr().err
