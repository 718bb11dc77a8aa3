"""Scoring over HTTP as vLLM serves it: /v1/completions with echo, logprobs: k and max_tokens: 0 (what lm-eval's
loglikelihood tasks send), chat's top_logprobs, and token strings made exactly as vLLM makes them."""

from __future__ import annotations

import json

import httpx
import pytest

from final.server.logprobs import Entry, TokenText, completion_logprobs

pytest_plugins = ["serve_helpers"]  # the served fixture: `final serve` of the tiny model on 127.0.0.1


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as client:
        yield client


def completion(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": "m", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_0_is_the_prompts_score(served, http):
    ids = served.inference.tokenizer("The capital of France is Paris").input_ids
    out = completion(http, prompt=[ids], max_tokens=0, echo=True, logprobs=3)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    [score] = served.inference.score([ids], top_logprobs=3)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before the first token
    assert lp["token_logprobs"][1:] == pytest.approx(score.prompt_logprobs[1:], abs=1e-5)
    assert lp["tokens"][0] == served.inference.tokenizer.decode(ids[0])
    assert "".join(lp["tokens"]) == choice["text"] == served.inference.tokenizer.decode(ids)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(ids))]
    for tok, value, top, alts in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                                     score.prompt_top_logprobs[1:]):
        assert list(top)[0] == tok and top[tok] == value  # the chosen token first, then the 3 best: k + 1 entries
        assert len(top) <= 4 and max(top.values()) == pytest.approx(alts[0][1], abs=1e-5)
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_lm_eval_reads_loglikelihoods_from_the_answer(served, http):
    """lm-eval's local-completions request (max_tokens 1, logprobs 1, echo) parsed by lm-eval's own parser."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tok = served.inference.tokenizer
    context, continuation = tok("Once upon a").input_ids, tok(" time", add_special_tokens=False).input_ids
    body = {"prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    [(logprob, greedy)] = LocalCompletionsAPI.parse_logprobs(completion(http, **body), ctxlens=[len(context)])
    [score] = served.inference.score([context], [continuation])
    assert logprob == pytest.approx(score.logprob, abs=1e-5) and greedy == score.is_greedy
    out = served.inference.generate([context], temperature=0, max_tokens=3)
    [(_, greedy)] = LocalCompletionsAPI.parse_logprobs(
        completion(http, **{**body, "prompt": [context + out.token_ids[0]]}), ctxlens=[len(context)])
    assert greedy  # the model's own greedy continuation


def test_echo_with_generation_and_text_prompts(served, http):
    out = completion(http, prompt=["Hello there", "General"], max_tokens=3, temperature=0, echo=True, logprobs=2)
    ref = served.inference.generate(["Hello there", "General"], raw=True, temperature=0, max_tokens=3,
                                    top_logprobs=2, prompt_logprobs=True)
    for choice, text, meta in zip(out["choices"], ref.completions, ref.metadata):
        prompt_len = len(meta["prompt_logprobs"])
        assert choice["text"] == ("Hello there", "General")[choice["index"]] + text  # vLLM: prompt as sent, then text
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == prompt_len + len(meta["response_ids"])
        assert lp["token_logprobs"][prompt_len:] == pytest.approx(meta["logprobs"], abs=1e-5)
        assert lp["token_logprobs"][1:prompt_len] == pytest.approx(meta["prompt_logprobs"][1:], abs=1e-5)
    plain = completion(http, prompt="Hello there", max_tokens=2, temperature=0, echo=True)
    assert plain["choices"][0]["text"].startswith("Hello there") and plain["choices"][0]["logprobs"] is None


def test_generated_tokens_logprobs_k(served, http):
    out = completion(http, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    lp = out["choices"][0]["logprobs"]
    ref = served.inference.generate("Once upon a time", raw=True, temperature=0, max_tokens=4, top_logprobs=2)
    assert lp["token_logprobs"] == pytest.approx(ref.metadata[0]["logprobs"], abs=1e-5)
    assert all(list(top)[0] == tok and len(top) <= 3 for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    zero = completion(http, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=0)
    assert [list(t) for t in zero["choices"][0]["logprobs"]["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_stream_sends_the_same_logprobs(http):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    whole = completion(http, **{k: v for k, v in body.items() if k != "model"})["choices"][0]["logprobs"]
    tokens, tops, offsets = [], [], []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                if lp:
                    tokens += lp["tokens"]
                    tops += lp["top_logprobs"]
                    offsets += lp["text_offset"]
    assert tokens == whole["tokens"] and tops == whole["top_logprobs"]
    assert offsets == whole["text_offset"]  # a chunk's offsets continue after the text already sent


def test_chat_top_logprobs(served, http):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 4,
                                               "temperature": 0, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    ref = served.inference.generate(messages, temperature=0, max_tokens=4, top_logprobs=3)
    text = TokenText(served.inference.tokenizer)
    for entry, top in zip(content, ref.metadata[0]["top_logprobs"]):
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([v for _, v in top], abs=1e-5)
        assert [t["token"] for t in entry["top_logprobs"]] == text.pieces([t for t, _ in top])
        assert entry["bytes"] == list(entry["token"].encode())


def test_token_strings_are_vllms():
    """Byte-fallback pieces of one character: vLLM decodes each again after the tokens before it, so the first
    pieces read "" and the last the whole character; the strings then join to the text."""
    from transformers import AutoTokenizer

    from final.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-random-llama"))
    ids = tok("I like 🍕 pizza").input_ids
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # the emoji is split over several tokens
    entries = TokenText(tok).entries(ids, [None] + [-1.0] * (len(ids) - 1), None)
    assert "".join(e.token for e in entries) == tok.decode(ids)
    assert [e.token for e in entries][3:6] == ["", "", " 🍕"]


def test_metaspace_leading_spaces_are_restored():
    """SentencePiece-style (Metaspace) tokenizers: decode() drops a lone piece's leading space; vLLM puts it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "hello": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert tok.decode([2]) == "world"  # what decode() alone gives
    assert TokenText(tok).pieces([1, 2, 3]) == [" hello", " world", "hello"]


def test_top_logprobs_dict_is_written_in_vllms_order():
    """Chosen token first, then the k best; an id seen twice keeps its first place; two ids with one text
    collide and the later value wins (a dict keyed by text, built in that order)."""
    e = Entry(5, "a", -2.0, [(7, "b", -0.5), (8, "b", -1.0), (5, "a", -2.0)])  # ids 7 and 8 both read "b"
    assert completion_logprobs([e], k=1)["top_logprobs"] == [{"a": -2.0, "b": -0.5}]  # ids 5, 7
    assert completion_logprobs([e], k=2)["top_logprobs"] == [{"a": -2.0, "b": -1.0}]  # ids 5, 7, 8: 8 overwrites
    assert completion_logprobs([e], k=3)["top_logprobs"] == [{"a": -2.0, "b": -1.0}]  # 5 is there already
    floor = completion_logprobs([Entry(1, "x", float("-inf"), [])], k=0)
    assert floor["token_logprobs"] == [-9999.0] and floor["top_logprobs"] == [{"x": -9999.0}]
