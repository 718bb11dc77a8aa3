"""The real `openai` Python client against `final serve` (tiny model, real HTTP on an ephemeral 127.0.0.1 port)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_helpers import start_served, stop_served

pytest_plugins = ["serve_helpers"]  # the served / carts fixtures

Q = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_ping_and_models(served, client):
    assert httpx.get(f"{served.url}/ping").json() == {"message": "pong"}
    assert [m.id for m in client.models.list()] == ["builtin:tiny-random-llama"]


def test_completions_text_and_token_ids(served, client):
    out = client.completions.create(model="default", prompt="Once upon a time", max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == "default"
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    # the same request through the engine (plain text, no chat template) gives the same tokens
    ref = served.inference.generate("Once upon a time", raw=True, temperature=0, max_tokens=8)
    assert out.choices[0].text == ref.completions[0]
    assert out.usage.completion_tokens == len(ref.token_ids[0])
    assert out.usage.prompt_tokens == ref.metadata[0]["prompt_tokens"]
    ids = served.inference.tokenizer("Once upon a time")["input_ids"]
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_chat_matches_the_engine(served, client):
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": Q}],
                                         max_tokens=10, temperature=0)
    ref = served.inference.generate(Q, temperature=0, max_tokens=10)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.completions[0]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    # max_completion_tokens is the newer name of max_tokens
    newer = client.chat.completions.create(model="default", messages=[{"role": "user", "content": Q}],
                                           max_completion_tokens=10, temperature=0)
    assert newer.choices[0].message.content == out.choices[0].message.content


def test_n_seed_and_sampling(client):
    kw = dict(model="default", prompt="Tell me a story", max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=11)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choice j uses seed+j
    two = client.completions.create(model="default", prompt=["One", "Two"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]  # prompt-major
    assert two.choices[0].text == two.choices[1].text and two.choices[2].text == two.choices[3].text


def test_logprobs_both_layouts(served, client):
    out = client.completions.create(model="default", prompt="Hello", max_tokens=5, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=5, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    ref = served.inference.generate("Hello", temperature=0, max_tokens=5, logprobs=True)
    assert [c.logprob for c in content] == pytest.approx(ref.metadata[0]["logprobs"], abs=1e-5)


def test_stop_strings_cut_the_text(client):
    free = client.completions.create(model="default", prompt="Once upon a time", max_tokens=12, temperature=0)
    words = free.choices[0].text.split()
    stop = words[2]
    out = client.completions.create(model="default", prompt="Once upon a time", max_tokens=12, temperature=0,
                                    stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and free.choices[0].text.startswith(out.choices[0].text)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_sends_increments_that_add_up(client, chat):
    if chat:
        kw = dict(model="default", messages=[{"role": "user", "content": Q}], max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    else:
        kw = dict(model="default", prompt="Once upon a time", max_tokens=12, temperature=0)
        whole = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == whole
    assert sum(1 for p in pieces if p) > 2  # real increments, not one block
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] or finals == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def _streamed_texts(client, **kw) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return texts


def test_streaming_n_and_stop(client):
    kw = dict(model="default", prompt="Tell me a story", max_tokens=8, temperature=1.0, n=2, seed=5)
    whole = client.completions.create(**kw)
    texts = _streamed_texts(client, **kw)
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    # a stop string never leaks into the stream, even when it spans several tokens
    free = client.completions.create(model="default", prompt="Once upon a time", max_tokens=12, temperature=0)
    stop = free.choices[0].text[5:14]
    kw = dict(model="default", prompt="Once upon a time", max_tokens=12, temperature=0, stop=stop)
    cut = client.completions.create(**kw).choices[0].text
    assert cut == free.choices[0].text[:5] and _streamed_texts(client, **kw) == {0: cut}


def test_sixteen_concurrent_requests(served, client):
    prompts = [f"Question number {i}: what comes next?" for i in range(16)]
    alone = [client.completions.create(model="default", prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]
    before = served.inference.engine.stats.decode_steps
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: client.completions.create(model="default", prompt=p, max_tokens=8,
                                                                     temperature=0).choices[0].text, prompts))
    assert together == alone
    # they shared the running batch: far fewer decode steps than 16 requests one after another
    assert served.inference.engine.stats.decode_steps - before < 16 * 7


def test_fifty_sequential_requests_then_still_alive(served, client):
    for i in range(50):
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": f"Say {i}"}],
                                             max_tokens=2, temperature=0)
        assert out.choices[0].message.content is not None
    assert httpx.get(f"{served.url}/ping").json() == {"message": "pong"}


def test_api_key_is_required_when_set():
    s = start_served(api_key="s3cret")
    try:
        bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            bad.completions.create(model="default", prompt="hi", max_tokens=2)
        assert exc.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="default", prompt="hi", max_tokens=2).choices
        assert httpx.get(f"{s.url}/ping").status_code == 200  # health checks need no key
    finally:
        stop_served(s)
