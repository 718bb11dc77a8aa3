"""Every surface of `final serve` under >= 150 generated malformed requests (tests/fuzz_surfaces.py): completions, chat,
the cartridge routes (/custom/cartridge/*, /v1/cartridge/*, GET /custom/cartridges) and the weight routes
(POST /update_weights_from_disk, GET /get_weight_version). The cases go out concurrently, mixed with good requests
whose greedy answers are known beforehand: each malformed one must get a typed 4xx (an OpenAI error body, naming
its field where it has one), each good one its exact answer, and the server must be alive afterwards with its
cartridges and weights untouched. Tool fields are the tools' fuzz (tests/test_tools_*)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
import torch

from conftest import tiny_config
from fuzz_surfaces import SAMPLES, Case, _at, _dump, field_cases, method_cases, raw_cases
from final.cartridges.format import CartridgeKV, save_cartridge
from final.inf import InferenceEngine
from final.protocol import bodies
from final.server.app import ServerThread, create_app
from final.server.weights import UpdateWeightsFromDiskRequest

MAX_BODY = 65536
CONCURRENCY = 8
COMPLETION = {"model": "m", "prompt": [1, 504, 3458], "max_tokens": 3, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}  # max_completion_tokens too
CART_ROUTES = ["/custom/cartridge/completions", "/custom/cartridge/chat/completions", "/v1/cartridge/completions",
               "/v1/cartridge/chat/completions"]
# the server names a field by the engine's name for it (final serve's errors: max_completion_tokens is max_tokens)
ALIASES = {"max_completion_tokens": "max_tokens"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("surfaces")
    out = {name: root / name for name in ("carts", "weights", "outside")}
    for path in out.values():
        path.mkdir()
    return out


@pytest.fixture(scope="module")
def served(folders):
    engine = InferenceEngine({**tiny_config(prompt_length=64, response_length=8),
                              "limits": {"max_body_bytes": MAX_BODY}})
    spec = engine.engine.spec
    shape = (1, spec.num_kv_heads, 4, spec.head_dim)
    gen = torch.Generator().manual_seed(0)
    kv = CartridgeKV([torch.randn(shape, generator=gen) for _ in range(spec.num_layers)],
                     [torch.randn(shape, generator=gen) for _ in range(spec.num_layers)], 1)
    save_cartridge(kv, folders["carts"] / "good.pt")
    save_cartridge(kv, folders["outside"] / "outside.pt")
    _weights_files(engine, folders)
    with ServerThread(create_app(engine, cartridge_dir=str(folders["carts"]),
                                 weights_dir=str(folders["weights"]))) as server, \
            ServerThread(create_app(engine)) as no_updates:
        yield engine, server.url, no_updates.url
    engine.shutdown()


def _weights_files(engine: InferenceEngine, folders: dict[str, Path]) -> None:
    """Update files the server must refuse (400 naming why), and a link out of its folder (403)."""
    from safetensors.torch import save_file

    from final.models import resolve_model_path
    from final.weights import hf_parameter_shapes

    weights = folders["weights"]
    name = "model.layers.0.mlp.down_proj.weight"
    shape = hf_parameter_shapes(resolve_model_path(engine.config.model_path))[name]
    save_file({"model.not_a_parameter.weight": torch.zeros(2, 2)}, str(weights / "unknown.safetensors"))
    save_file({name: torch.zeros(2)}, str(weights / "shape.safetensors"))
    save_file({name: torch.full(shape, math.nan)}, str(weights / "nan.safetensors"))
    save_file({name: torch.zeros(shape, dtype=torch.int32)}, str(weights / "ints.safetensors"))
    (weights / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    (weights / "empty.safetensors").write_bytes(b"")
    (weights / "pickle.pt").write_bytes(b"\x80\x04K\x01.")
    (weights / "folder").mkdir()
    (weights / "folder" / "notes.txt").write_text("no weights here")
    (weights / "escape").symlink_to(folders["outside"])


def _completion_cases() -> list[Case]:
    cases = list(field_cases(bodies.CompletionsRequest, COMPLETION))
    cases += [Case(f"prompt={name}", _dump({**COMPLETION, "prompt": value}), param="prompt")
              for name, value in [("empty", []), ("nested-empty", [[]]), ("negative id", [-1]), ("id past vocab",
                                  [10**9]), ("float ids", [1.5]), ("mixed", [[1, "a"]]), ("deep", [[[1]]]),
                                  ("too long", [5] * 5000), ("empty string", ""), ("empty strings", ["", ""])]]
    cases += [Case(f"{k}={v}", _dump({**COMPLETION, k: v}), param=k)
              for k, v in [("n", 0), ("n", -1), ("n", 10**6), ("max_tokens", -1), ("max_tokens", 10**6),
                           ("top_k", 0), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.5),
                           ("temperature", -1.0), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
                           ("repetition_penalty", 0.0), ("repetition_penalty", 9.0), ("logprobs", -1),
                           ("logprobs", 10**6), ("best_of", 5), ("seed", 2**70), ("stop", [""]),
                           ("stop", ["s"] * 1000), ("suffix", "tail"), ("echo", True)]
              if not (k == "echo")]
    return cases + list(raw_cases(COMPLETION, MAX_BODY))


def _message_cases() -> list[Case]:
    bad_messages = [[], [5], ["hi"], [{}], [None], [{"role": "user"}], [{"content": "hi"}],
                    [{"role": "user", "content": "hi " * 2000}], [{"role": "user", "content": "hi"}] * 400]
    cases = [Case(f"messages={json.dumps(m)[:40]}", _dump({**CHAT, "messages": m}), param="messages")
             for m in bad_messages]
    for key in ("role", "content"):
        for kind, value in SAMPLES:
            if kind == "string" or (key == "content" and kind == "array" and value == []):
                continue
            cases.append(Case(f"messages.0.{key}={kind}:{json.dumps(value)}",
                              _dump(_at(CHAT, ["messages", 0, key], value)), param="messages"))
    for role in ("wizard", "", "USER", "user "):
        cases.append(Case(f"role {role!r}", _dump(_at(CHAT, ["messages", 0, "role"], role)), param="messages"))
    for parts in ([{"type": "text"}], [{"type": "text", "text": 5}], [5], [{"type": "image_url", "image_url":
                  {"url": "http://127.0.0.1/x.png"}}], [{"text": "hi"}], [{"type": "audio", "text": "hi"}]):
        cases.append(Case(f"content parts {json.dumps(parts)[:40]}", _dump(_at(CHAT, ["messages", 0, "content"],
                                                                                 parts)), param="messages"))
    return cases


def _chat_cases() -> list[Case]:
    cases = list(field_cases(bodies.ChatCompletionRequest, CHAT)) + _message_cases()
    cases += [Case(f"{k}={v}", _dump({**CHAT, k: v}), param=k)
              for k, v in [("n", 0), ("n", 10**6), ("max_tokens", -1), ("max_tokens", 10**6), ("top_k", 0),
                           ("top_p", 1.5), ("temperature", -1.0), ("top_logprobs", 21), ("top_logprobs", -1),
                           ("max_completion_tokens", -4), ("seed", 2**70), ("stop", [""])]]
    return cases + list(raw_cases(CHAT, MAX_BODY))


def _cartridge_cases() -> list[Case]:
    good = {**COMPLETION, "cartridges": [{"id": "good.pt", "source": "local"}]}
    cases = [c for c in field_cases(bodies.CartridgeCompletionsRequest, good)
             if (c.param or c.name).startswith("cartridges")]
    ids = ["", " ", "\x00", "a\x00b", "../outside/outside.pt", "../" * 12 + "etc/passwd", "/etc/passwd", "x" * 5000,
           "missing.pt", "good.pt/..", "..", ".", "%2e%2e/outside/outside.pt", "good.pt\n", "\\..\\x", "~/x.pt",
           "good.pt/x", "🙂" * 1000, "folder/", "CON"]
    cases += [Case(f"id {cid[:30]!r}", _dump(_at(good, ["cartridges", 0, "id"], cid)), param="cartridges")
              for cid in ids]
    remote = _at(good, ["cartridges", 0, "id"], "org/remote-cartridge")  # not resident: it would be downloaded
    cases += [Case(f"source {src!r}", _dump(_at(remote, ["cartridges", 0, "source"], src)), param="cartridges")
              for src in ("ftp", "LOCAL", "", "wandb", "huggingface", "s3", "hf", "local ")]
    cases += [Case(f"positions {p!r}", _dump(_at(good, ["cartridges", 0, "positions"], p)), param="cartridges")
              for p in ("sideways", "", "AFTER_PREFIX")]
    cases += [Case("a remote id forced to download", _dump({**good, "cartridges": [
        {"id": "hazy/x", "source": "wandb", "force_redownload": True}]}), param="cartridges")]
    for i, case in enumerate(cases):  # spread over the four cartridge routes (chat ones get a chat body)
        route = CART_ROUTES[i % len(CART_ROUTES)]
        if "chat" in route and case.body is not None:
            body = json.loads(case.body)
            if isinstance(body, dict) and "prompt" in body:
                body["messages"] = [{"role": "user", "content": "hi"}]
                del body["prompt"]
                case.body = _dump(body)
        case.path = route
    chat = {**CHAT, "cartridges": good["cartridges"]}
    for block in ("{", "[]", '{"id": 5}', '{"id": "x", "source": "ftp"}', '{"id": "../outside/outside.pt", '
                  '"source": "local"}', '{"id": "good.pt", "bogus": 1}', "", "not json", '{"id": ""}',
                  '{"id": "missing.pt", "source": "local"}'):
        body = {**CHAT, "messages": [{"role": "system", "content": f"<cartridge>{block}</cartridge>"},
                                     {"role": "user", "content": "hi"}]}
        cases.append(Case(f"system block {block[:30]!r}", _dump(body), path="/v1/chat/completions"))
    cases.append(Case("block and field together", _dump({**chat, "messages": [
        {"role": "system", "content": '<cartridge>{"id": "good.pt", "source": "local"}</cartridge>'},
        {"role": "user", "content": "hi"}]}), path=CART_ROUTES[1], param="cartridges"))
    for route in CART_ROUTES:  # bodies that are not a request, on each route
        base = good if "chat" not in route else {**CHAT, "cartridges": good["cartridges"]}
        cases += [Case(c.name, c.body, c.method, c.headers, c.param, route) for c in raw_cases(base, MAX_BODY)]
    return cases + list(method_cases("/custom/cartridges"))


def _weights_cases() -> list[Case]:
    good = {"model_path": "unknown.safetensors", "keep_cartridges": False}  # well-formed; refused for its file
    cases = list(field_cases(UpdateWeightsFromDiskRequest, good))
    paths = ["unknown.safetensors", "shape.safetensors", "nan.safetensors", "ints.safetensors", "corrupt.safetensors",
             "empty.safetensors", "pickle.pt", "folder", "missing.safetensors", "", " ", "\x00", "a\x00b",
             "../outside", "../" * 12 + "etc", "/etc", "/", "x" * 5000, "escape", "escape/outside.pt",
             "%2e%2e/outside", "~", ".."]
    cases += [Case(f"model_path {prefix + p!r:.40}", _dump({**good, "model_path": prefix + p}))
              for p in paths for prefix in ("", "./", "folder/../")]
    cases += [Case(f"load_format {f!r}", _dump({**good, "load_format": f}), param="load_format")
              for f in ("pickle", "dummy", "", "gguf", "pt")]
    cases.append(Case("abort_all_requests", _dump({**good, "abort_all_requests": True}), param="abort_all_requests"))
    cases += list(raw_cases(good, MAX_BODY)) + list(method_cases("/get_weight_version"))
    return cases


SURFACES = {"completions": ("/v1/completions", _completion_cases), "chat": ("/v1/chat/completions", _chat_cases),
            "cartridges": ("/custom/cartridge/completions", _cartridge_cases),
            "weights": ("/update_weights_from_disk", _weights_cases)}


async def _send(client: httpx.AsyncClient, case: Case, path: str) -> httpx.Response:
    body = case.body
    if body is not None and not isinstance(body, bytes):  # a body of unknown length, in chunks
        chunks = list(body)

        async def stream():
            for chunk in chunks:
                yield chunk

        body = stream()
    return await client.request(case.method, case.path or path, content=body, headers=case.headers)


async def _storm(url: str, cases: list[Case], path: str, good: list[tuple[str, dict, str]]) -> list:
    """Every case and, between them, the good requests, CONCURRENCY at a time: (case or good, response)."""
    work: list = []
    for i, case in enumerate(cases):
        work.append(case)
        if i % 10 == 0:
            work.append(good[(i // 10) % len(good)])
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(item):
            async with limit:
                if isinstance(item, Case):
                    return item, await _send(client, item, path)
                route, body, _ = item
                return item, await client.post(route, json=body)

        return await asyncio.gather(*(one(item) for item in work))


def _good_requests(url: str) -> list[tuple[str, dict, str]]:
    """Good requests and their answers, asked before the storm (greedy: the same answer every time)."""
    with httpx.Client(base_url=url, timeout=120) as client:
        out = []
        for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                            (CART_ROUTES[0], {**COMPLETION, "cartridges": [{"id": "good.pt", "source": "local"}]})):
            resp = client.post(route, json=body)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            out.append((route, body, choice.get("text", (choice.get("message") or {}).get("content"))))
    return out


@pytest.mark.parametrize("surface", list(SURFACES))
def test_every_malformed_request_is_a_typed_4xx_and_good_ones_are_unharmed(served, surface):
    engine, url, _ = served
    path, make = SURFACES[surface]
    cases = make()
    assert len(cases) >= 150, (surface, len(cases))
    good = _good_requests(url)
    version, cartridges = engine.weights_version, engine.cartridge_ids()
    results = asyncio.run(_storm(url, cases, path, good))
    wrong = []
    for item, resp in results:
        if not isinstance(item, Case):
            text = resp.json()["choices"][0] if resp.status_code == 200 else None
            answer = text and text.get("text", (text.get("message") or {}).get("content"))
            if resp.status_code != 200 or answer != item[2]:
                wrong.append(f"good {item[0]}: {resp.status_code} {resp.text[:200]}")
            continue
        problem = _typed_4xx(resp, item)
        if problem:
            wrong.append(f"{item.name!r} on {item.method} {item.path or path}: {problem}")
    assert not wrong, f"{len(wrong)} of {len(results)}:\n" + "\n".join(wrong[:40])
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/ping").json() == {"message": "pong"}
        assert client.get("/get_weight_version").json() == {"weight_version": version}
    # no malformed request changed the weights or left a cartridge loaded (the good ones' was loaded before)
    assert engine.weights_version == version and set(engine.cartridge_ids()) <= set(cartridges)


def _typed_4xx(resp: httpx.Response, case: Case) -> str | None:
    if not 400 <= resp.status_code < 500:
        return f"status {resp.status_code}: {resp.text[:300]}"
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {resp.text[:300]}"
    if not err.get("message") or not err.get("type"):
        return f"error without message or type: {err}"
    root = case.param and case.param.split(".")[0]
    expected = (root, ALIASES.get(root, root))
    if root and resp.status_code not in (405, 413) and not str(err.get("param") or "").startswith(expected):
        return f"param {err.get('param')!r}, expected {expected!r}: {err['message'][:200]}"
    return None


def test_a_server_without_weight_updates_refuses_every_update_with_403(served):
    engine, _, url = served
    cases = [c for c in _weights_cases() if c.method == "POST" and c.path is None and isinstance(c.body, bytes)]
    with httpx.Client(base_url=url, timeout=60) as client:
        statuses = {client.post("/update_weights_from_disk", content=c.body, headers=c.headers).status_code
                    for c in cases}
        assert statuses == {403} and client.get("/get_weight_version").json() == {"weight_version": 0}


def test_the_counts_per_surface():
    """What the module tried (bench/RESULTS.md's reliability rows): >= 150 generated cases a surface."""
    counts = {name: len(make()) for name, (_, make) in SURFACES.items()}
    print("fuzz cases per surface:", counts)
    assert min(counts.values()) >= 150, counts
