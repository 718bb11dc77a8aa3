"""The embedded engine's `async_generate(stream=True)` that `final serve` streams from (SGLang 0.5.2's shape:
cumulative output_ids per new token, finish_reason on the last)."""

from __future__ import annotations

import asyncio

import pytest

from final.errors import SamplingError

PROMPT = [1, 504, 3458, 2, 17, 99]


def test_stream_adds_up_to_the_whole_answer(tiny_engine):
    params = {"max_new_tokens": 6, "temperature": 0}

    async def run():
        whole = await tiny_engine.async_generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
        stream = await tiny_engine.async_generate(input_ids=PROMPT, sampling_params=params, return_logprob=True,
                                                  stream=True)
        return whole, [c async for c in stream]

    whole, chunks = asyncio.run(run())
    assert [c["output_ids"] for c in chunks] == [whole["output_ids"][:i] for i in range(1, 7)]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 5
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


def test_closing_a_stream_aborts_its_request(tiny_engine):
    async def run():
        before = tiny_engine.stats.aborted
        stream = await tiny_engine.async_generate(input_ids=PROMPT, stream=True,
                                                  sampling_params={"max_new_tokens": 500, "ignore_eos": True})
        first = await stream.__anext__()
        await stream.aclose()
        for _ in range(400):
            if tiny_engine.stats.aborted > before:
                break
            await asyncio.sleep(0.01)
        return first, tiny_engine.stats.aborted - before

    first, aborted = asyncio.run(run())
    assert len(first["output_ids"]) == 1 and aborted == 1
    assert not tiny_engine.scheduler.running


def test_stream_takes_one_prompt_and_n_1(tiny_engine):
    async def run(**kw):
        return await tiny_engine.async_generate(stream=True, **kw)

    with pytest.raises(SamplingError, match="stream"):
        asyncio.run(run(input_ids=PROMPT, sampling_params={"n": 2}))
    with pytest.raises(SamplingError, match="stream"):
        asyncio.run(run(input_ids=[PROMPT, PROMPT]))
