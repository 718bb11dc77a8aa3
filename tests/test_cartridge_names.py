"""No cartridge name a client sends makes `final serve` answer 500 (issue 29 item 3), and no name reads a file
outside --cartridge-dir. Every field that names a cartridge goes through final.protocol.cartridge_spec before the
filesystem: request bodies' `cartridges`, `<cartridge>` blocks in system messages, generate(cartridge=...),
load_cartridge, the config's and the tokasaurus backend's cartridges.

One real `final serve` (the tiny model) runs for the module, in a working folder that holds a valid cartridge of
another size than those under --cartridge-dir (so a request that read it, by a relative path, `../`, an absolute
path or a symlink leading out, shows in /custom/cartridges). Hypothesis sends it generated ids and blocks on the
three routes that read them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY, tiny_config
from final.cartridges.format import CartridgeKV, save_cartridge
from final.cartridges.manifest import ModelShape
from final.cartridges.sources import sanitize_cartridge_id
from final.config import load_config
from final.errors import CartridgeError, ConfigError
from final.models import resolve_model_path
from final.protocol.cartridge_spec import MAX_NAME_BYTES, MAX_PART_BYTES, name_problem
from final.rollout.tokasaurus import TokasaurusSettings
from serve_helpers import spawn_serve, stop_serve

ROUTES = ("/custom/cartridge/completions", "/custom/cartridge/chat/completions", "/v1/chat/completions")
INSIDE_TOKENS, OUTSIDE_TOKENS = 4, 9  # the outside cartridge's size gives it away in /custom/cartridges
TOKA_ID = "team/doc.v1"  # Tokasaurus' layout: <cartridge-dir>/<sanitized id>/cartridge.pt
FUZZ = settings(max_examples=70, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _cart(tokens: int) -> CartridgeKV:
    shape = ModelShape.of(resolve_model_path(TINY))
    kv = (1, shape.num_kv_heads, tokens, shape.head_dim)
    return CartridgeKV([torch.randn(kv).bfloat16() for _ in range(shape.num_layers)],
                       [torch.randn(kv).bfloat16() for _ in range(shape.num_layers)], 1)


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict[str, Path]:
    """root/carts (--cartridge-dir): good.pt, a Tokasaurus folder, a link that stays inside and two that lead
    out; root/work (the server's working folder): evil.pt, the cartridge no request may get."""
    root = tmp_path_factory.mktemp("names")
    carts, work = root / "carts", root / "work"
    save_cartridge(_cart(INSIDE_TOKENS), carts / "good.pt")
    save_cartridge(_cart(INSIDE_TOKENS), carts / sanitize_cartridge_id(TOKA_ID) / "cartridge.pt")
    evil = save_cartridge(_cart(OUTSIDE_TOKENS), work / "evil.pt")
    save_cartridge(_cart(OUTSIDE_TOKENS), work / "cartridge.pt")  # the folder `..` would stand for
    os.symlink(carts / "good.pt", carts / "inner.pt")
    os.symlink(evil, carts / "escape.pt")
    os.symlink(work, carts / "escape_dir")
    return {"carts": carts, "work": work, "evil": evil}


@pytest.fixture(scope="module")
def http(layout):
    url, proc = spawn_serve("--model", TINY, "--cartridge-dir", str(layout["carts"]), cwd=layout["work"])
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client
    finally:
        stop_serve(proc)


def _body(route: str, cartridge: dict | None = None, system: str | None = None) -> dict:
    body: dict = {"model": "m", "max_tokens": 1, "temperature": 0}
    if route.endswith("/completions") and "chat" not in route:
        body["prompt"] = "hi"
    else:
        body["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": "hi"}]
    if cartridge is not None:
        if route.startswith("/v1/"):  # the OpenAI route takes cartridges only as a system message's block
            body["messages"].insert(0, {"role": "system", "content": f"<cartridge>{json.dumps(cartridge)}</cartridge>"})
        else:
            body["cartridges"] = [cartridge]
    return body


def _loaded_sizes(http: httpx.Client) -> dict[str, int]:
    usage = http.get("/custom/cartridges").json()
    return {c["id"]: c["bytes"] for c in usage["cartridges"] or []}


def _still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def _refused_naming(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "invalid_cartridge" and f"'{field}" in err["message"], err
    assert len(err["message"]) < 400  # the id is quoted cut, not echoed whole


# ---- the measured defects (500s before this change) ------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("cid", ["x" * 5000, "doc\x00.pt", "/".join(["a"] * 600)], ids=["long", "nul", "deep"])
def test_a_name_the_os_cannot_take_is_a_400(http, route, cid):
    field = "messages[0].content.id" if route.startswith("/v1/") else "cartridges[0].id"
    r = http.post(route, json=_body(route, {"id": cid, "source": "local"}))
    _refused_naming(r, field)
    _still_serves(http)


@pytest.mark.parametrize("route", ROUTES[1:])
@pytest.mark.parametrize("block", ["", "[]", " 1 ", "null", '"good.pt"', '{"id": "good.pt"} trailing'])
def test_an_empty_or_non_object_block_is_a_400(http, route, block):
    r = http.post(route, json=_body(route, system=f"Be brief. <cartridge>{block}</cartridge>"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_cartridge" and err["param"] == "messages", err
    assert "messages[0].content" in err["message"] and "<cartridge> block" in err["message"]
    _still_serves(http)


def test_legal_names_still_load(http, layout):
    """What worked keeps working: a file, a link that stays inside, Tokasaurus' folder, an absolute path inside."""
    for route in ROUTES:
        for cid in ("good.pt", "inner.pt", TOKA_ID, str(layout["carts"] / "good.pt"), "./good.pt"):
            r = http.post(route, json=_body(route, {"id": cid, "source": "local"}))
            assert r.status_code == 200, (route, cid, r.text)
    for cid in ("escape.pt", "escape_dir/evil.pt", "../work/evil.pt", str(layout["evil"]), "evil.pt", ".."):
        r = http.post(ROUTES[0], json=_body(ROUTES[0], {"id": cid, "source": "local"}))
        assert r.status_code == 400, (cid, r.text)
    assert len(set(_loaded_sizes(http).values())) == 1  # every cartridge loaded so far is an inside one


@pytest.mark.parametrize("route", ROUTES)
def test_a_legal_name_too_long_for_tokasaurus_folder_is_a_400(http, route):
    """300 parts pass the name rule (599 bytes) but its Tokasaurus folder name (slashes -> '-') would be past
    NAME_MAX: that folder is not looked for, and the file does not exist."""
    r = http.post(route, json=_body(route, {"id": "/".join(["a"] * 300), "source": "local"}))
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"], r.text[:300]
    _still_serves(http)


# ---- generated names and blocks, on every route --------------------------------------------------------------
PARTS = ["..", ".", "", "good.pt", "evil.pt", "cartridge.pt", "escape.pt", "escape_dir", "inner.pt", "team",
         "doc.v1", "~", "x" * 300, "\x00", "\n", "é" * 130]


def _ids(layout: dict[str, Path]) -> st.SearchStrategy[str]:
    prefixes = st.sampled_from(["", "/", str(layout["carts"]) + "/", str(layout["work"]) + "/", "~/", "./"])
    paths = st.tuples(prefixes, st.lists(st.sampled_from(PARTS), max_size=6)).map(lambda t: t[0] + "/".join(t[1]))
    long = st.tuples(st.characters(), st.integers(200, 3000)).map(lambda t: t[0] * t[1])
    return st.one_of(st.text(max_size=40), paths, long, st.sampled_from([TOKA_ID, "good.pt", str(layout["evil"])]))


def _specs(layout: dict[str, Path]) -> st.SearchStrategy[dict]:
    sources = st.sampled_from(["local", "local", "local", "wandb", "huggingface", "s3"])
    extra = st.dictionaries(st.sampled_from(["force_redownload", "positions", "path", "pin"]),
                            st.one_of(st.booleans(), st.sampled_from(["from_zero", "after_prefix", "good.pt"])),
                            max_size=2)
    return st.builds(lambda cid, src, more: {"id": cid, "source": src, **more}, _ids(layout), sources, extra)


def _blocks(layout: dict[str, Path]) -> st.SearchStrategy[str]:
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=3), max_leaves=8)
    return st.one_of(st.text(max_size=60), json_values.map(json.dumps), _specs(layout).map(json.dumps))


def _check(http: httpx.Client, layout: dict[str, Path], r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code == 200:  # whatever it loaded came from inside --cartridge-dir
        sizes = _loaded_sizes(http)
        assert len(set(sizes.values())) <= 1, sizes


def _fuzz_route(http: httpx.Client, layout: dict[str, Path], route: str) -> None:
    @FUZZ
    @given(data=st.data())
    def run(data) -> None:
        if route.startswith("/v1/") or data.draw(st.booleans()):
            body = _body(route, system=f"<cartridge>{data.draw(_blocks(layout))}</cartridge>")
        else:
            body = _body(route, data.draw(_specs(layout)))
        _check(http, layout, http.post(route, json=body))

    run()
    _still_serves(http)


@pytest.mark.parametrize("route", ROUTES)
def test_generated_names_never_500_nor_leave_the_folder(http, layout, route):
    _fuzz_route(http, layout, route)


# ---- the Python and config entry points share the rule --------------------------------------------------------
@pytest.mark.parametrize("name", ["hazy-research/cartridges/abc123", "abc123", "org/name/sub/cartridge.pt",
                                  "s3://bucket/key/cartridge.pt", "../runs/cache_last.pt", "/data/run 1/é.pt",
                                  "p" * MAX_PART_BYTES, "/".join(["p" * 200] * 5)])
def test_legal_names_pass(name):
    assert name_problem(name) is None


@pytest.mark.parametrize("name,words", [("", "non-empty"), ("  ", "non-empty"), ("a\x00b", "U+0000"),
                                        ("a\x7fb", "U+007F"), ("a\x85b", "U+0085"), ("a\ud800", "surrogate"),
                                        ("p" * (MAX_PART_BYTES + 1), "between slashes"),
                                        ("é" * 128, "between slashes"), ("/".join(["p" * 200] * 6), "bytes long"),
                                        (3, "string")])
def test_illegal_names_say_why(name, words):
    assert words in name_problem(name)
    assert MAX_NAME_BYTES == 1024 and MAX_PART_BYTES == 255  # what README documents


def test_config_and_tokasaurus_settings_refuse_bad_names(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config({**tiny_config(), "cartridges": [{"id": "doc\x00", "source": "local"}]})
    assert exc.value.key == "cartridges[0].id"
    with pytest.raises(ConfigError) as exc:
        TokasaurusSettings.from_custom({"cartridges": [{"id": "x" * 5000, "source": "wandb"}]})
    assert exc.value.key == "rollout.custom.cartridges[0].id" and len(str(exc.value)) < 300


def test_generate_and_load_refuse_bad_names(tiny_inference):
    for cartridge, field in (("x" * 5000, "cartridge"), ({"id": "a\x00", "source": "local"}, "cartridges[0].id"),
                             ([{"id": "ok", "path": "a/" * 2100}], "cartridges[0].path")):
        with pytest.raises(CartridgeError) as exc:
            tiny_inference.generate("hi", cartridge=cartridge, max_tokens=1)
        assert exc.value.field == field
    with pytest.raises(CartridgeError) as exc:
        tiny_inference.load_cartridge(path="p" * 300)
    assert exc.value.field == "path"
    assert tiny_inference.generate("hi", max_tokens=1).completions
