"""Cartridge sources against real servers and caches: S3 on a moto server bound to 127.0.0.1, Hugging Face through
huggingface_hub's own cache resolution with HF_HUB_OFFLINE=1, local files, sanitised cache names, missing extras."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cartridges_helpers import open_engine, random_cart

from final.cartridges.format import load_cartridge, save_cartridge
from final.cartridges.manifest import CartridgeManifest, manifest_path
from final.cartridges.service import CartridgeService
from final.cartridges.sources import fetch, latest_wandb_cache_file, safe_name
from final.errors import CartridgeError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine():
    eng, _ = open_engine()
    yield eng
    eng.shutdown()


def _key0(engine, cid: str) -> torch.Tensor:
    return engine.prefixes.get((cid,)).k[0]


@pytest.fixture(scope="module")
def moto_url():
    pytest.importorskip("moto.server", reason="pip install 'moto[server]' (in the [test] extra)")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def s3(moto_url, monkeypatch):
    import boto3

    for key, value in {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket="carts")
    yield client
    for obj in client.list_objects_v2(Bucket="carts").get("Contents", []):
        client.delete_object(Bucket="carts", Key=obj["Key"])
    client.delete_bucket(Bucket="carts")


def _upload(client, tmp_path, key, cart, manifest=True):
    path = save_cartridge(cart, tmp_path / Path(key).name)
    client.upload_file(str(path), "carts", key)
    if manifest:
        m = CartridgeManifest.describe(cart, path, cartridge_id=key).write(path)
        client.upload_file(str(m), "carts", key + ".manifest.json")
    return path


def test_s3_download_cache_and_force_redownload(s3, engine, tmp_path):
    cache = tmp_path / "cache"
    service = CartridgeService(engine, cache_dir=cache)
    _upload(s3, tmp_path, "team/doc.pt", random_cart(seed=1))
    uri = "s3://carts/team/doc.pt"
    assert service.load(id=uri, source="s3") == uri
    cached = list((cache / "s3").rglob("doc.pt"))
    assert len(cached) == 1 and manifest_path(cached[0]).is_file()
    assert torch.equal(_key0(engine, uri)[None], random_cart(seed=1).keys[0])
    service.unload(uri)
    # A new service on the same cache does not download again (the object is gone from S3 now).
    s3.delete_object(Bucket="carts", Key="team/doc.pt")
    s3.delete_object(Bucket="carts", Key="team/doc.pt.manifest.json")
    other = CartridgeService(engine, cache_dir=cache)
    assert other.ensure([{"id": uri, "source": "s3", "force_redownload": False}]) == (uri,)
    # force_redownload goes back to S3: gone -> a typed error; replaced -> the new content.
    with pytest.raises(CartridgeError) as e:
        other.load(id=uri, source="s3", force_redownload=True)
    assert (e.value.file, e.value.field) == (uri, "id") and "does not exist" in str(e.value)
    _upload(s3, tmp_path / "up", "team/doc.pt", random_cart(seed=2))
    other.load(id=uri, source="s3", force_redownload=True)
    assert torch.equal(_key0(engine, uri)[None], random_cart(seed=2).keys[0])
    other.unload(uri)


def test_s3_without_manifest_and_offline_cache_hit(s3, engine, tmp_path, monkeypatch):
    _upload(s3, tmp_path, "plain.pt", random_cart(seed=9), manifest=False)
    uri = "s3://carts/plain.pt"
    got = fetch("s3", uri, cache_dir=tmp_path / "cache")
    assert got.manifest is None and torch.equal(load_cartridge(got.path).keys[1], random_cart(seed=9).keys[1])
    # S3 unreachable (nothing listens on this port): the cached copy serves, a forced re-download fails typed.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert fetch("s3", uri, cache_dir=tmp_path / "cache").path == got.path
    with pytest.raises(CartridgeError) as e:
        fetch("s3", uri, cache_dir=tmp_path / "cache", force_redownload=True)
    assert e.value.field == "source"


def test_s3_checksum_is_verified(s3, engine, tmp_path):
    path = _upload(s3, tmp_path, "bad.pt", random_cart(seed=3), manifest=False)
    m = CartridgeManifest.describe(random_cart(seed=4), save_cartridge(random_cart(seed=4), tmp_path / "x.pt"),
                                   cartridge_id="bad")
    m.size = path.stat().st_size
    s3.put_object(Bucket="carts", Key="bad.pt.manifest.json", Body=m.to_json().encode())
    with pytest.raises(CartridgeError) as e:
        CartridgeService(engine, cache_dir=tmp_path / "c").load(id="s3://carts/bad.pt", source="s3")
    assert e.value.field == "sha256" and "s3://carts/bad.pt" not in engine.cartridge_ids()


def test_s3_bad_uri_and_missing_bucket(s3, tmp_path):
    with pytest.raises(CartridgeError) as e:
        fetch("s3", "carts/no-scheme.pt", cache_dir=tmp_path)
    assert e.value.field == "id"
    with pytest.raises(CartridgeError) as e:
        fetch("s3", "s3://no-such-bucket/x.pt", cache_dir=tmp_path)
    assert e.value.field == "id"


def test_cache_names_are_sanitised(tmp_path):
    for cid in ("../../etc/passwd", "a/../../b", "/abs/path", "..", "x" * 500, "weird name?*:|"):
        name = safe_name(cid)
        assert "/" not in name and not name.startswith(".") and len(name) <= 91
        assert (tmp_path / name).resolve().parent == tmp_path.resolve()
    assert safe_name("a/b") != safe_name("a_b")  # distinct ids never share a cache folder


def test_s3_key_with_traversal_stays_in_the_cache(s3, tmp_path):
    key = "../../escape.pt"
    _upload(s3, tmp_path, key, random_cart(seed=5), manifest=False)
    before = set(tmp_path.parent.iterdir())
    got = fetch("s3", f"s3://carts/{key}", cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache").resolve() in got.path.resolve().parents
    assert set(tmp_path.parent.iterdir()) == before
    assert torch.equal(load_cartridge(got.path).keys[0], random_cart(seed=5).keys[0])


def _hf_cache(root: Path, repo: str, files: dict[str, bytes]) -> None:
    """huggingface_hub's documented cache layout: refs/main -> commit, snapshots/<commit>/<file>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / "huggingface" / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    for name, data in files.items():
        target = base / "snapshots" / commit / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


# Runs in a fresh interpreter so HF_HUB_OFFLINE=1 is read by huggingface_hub at import, as in real use.
_HF_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[2])
from cartridges_helpers import open_engine
from final.cartridges.service import CartridgeService
from final.errors import CartridgeError
engine, _ = open_engine()
service = CartridgeService(engine, cache_dir=sys.argv[1])
out = {}
for spec in json.loads(sys.argv[3]):
    try:
        cid = service.load(**spec)
        out[spec.get("path") or spec["id"]] = ["ok", cid, engine.prefixes.get((cid,)).k[0].sum().item()]
        service.unload(cid)
    except CartridgeError as e:
        out[spec.get("path") or spec["id"]] = ["error", e.field, str(e)]
engine.shutdown()
print(json.dumps(out))
"""


def test_huggingface_offline_cache(tmp_path):
    cart = random_cart(seed=6)
    src = save_cartridge(cart, tmp_path / "cartridge.pt")
    manifest = CartridgeManifest.describe(cart, src, cartridge_id="org/doc").to_json().encode()
    named = save_cartridge(cart, tmp_path / "n.safetensors").read_bytes()
    _hf_cache(tmp_path / "cache", "org/doc", {"cartridge.pt": src.read_bytes(), "cartridge.pt.manifest.json": manifest,
                                              "sub/named.safetensors": named})
    specs = [{"id": "org/doc", "source": "huggingface"},  # default file name, manifest checked
             {"id": "org/doc", "source": "huggingface", "path": "sub/named.safetensors"},
             {"id": "org/doc/sub/named.safetensors", "source": "huggingface"},  # the file named in the id
             {"id": "org/missing", "source": "huggingface"},
             {"id": "../../etc", "source": "huggingface"}]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _HF_SCRIPT, str(tmp_path / "cache"), str(ROOT / "tests"),
                           json.dumps(specs)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    total = cart.keys[0].sum().item()
    assert out["org/doc"][:2] == ["ok", "org/doc"] and out["org/doc"][2] == pytest.approx(total)
    assert out["sub/named.safetensors"][:2] == ["ok", "org/doc"]
    assert out["org/doc/sub/named.safetensors"][:2] == ["ok", "org/doc/sub/named.safetensors"]
    assert out["org/doc/sub/named.safetensors"][2] == pytest.approx(total)
    assert out["org/missing"][:2] == ["error", "id"] and "offline" in out["org/missing"][2]
    assert out["../../etc"][:2] == ["error", "id"]


def test_huggingface_checksum_is_verified_through_the_cache(tmp_path):
    cart = random_cart(seed=7)
    src = save_cartridge(cart, tmp_path / "cartridge.pt")
    m = CartridgeManifest.describe(cart, src, cartridge_id="org/bad")
    m.sha256 = "0" * 64
    _hf_cache(tmp_path / "cache", "org/bad", {"cartridge.pt": src.read_bytes(),
                                              "cartridge.pt.manifest.json": m.to_json().encode()})
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _HF_SCRIPT, str(tmp_path / "cache"), str(ROOT / "tests"),
                           json.dumps([{"id": "org/bad", "source": "huggingface"}])], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["org/bad"][:2] == ["error", "sha256"]


def test_local_source_and_manifest_beside_it(tmp_path):
    cart = random_cart(seed=8)
    path = save_cartridge(cart, tmp_path / "doc.safetensors")
    assert fetch("local", str(path)).manifest is None
    CartridgeManifest.describe(cart, path, cartridge_id="doc").write(path)
    got = fetch("local", "any-id", str(path))
    assert got.path == path and got.manifest == manifest_path(path)
    assert torch.equal(load_cartridge(got.path).values[1], cart.values[1])
    with pytest.raises(CartridgeError) as e:
        fetch("local", str(tmp_path / "missing.pt"))
    assert e.value.field == "path"
    with pytest.raises(CartridgeError) as e:
        fetch("gopher", "x")
    assert e.value.field == "source"


@pytest.mark.parametrize("module,source,extra", [("boto3", "s3", "s3"), ("huggingface_hub", "huggingface", "hf"),
                                                 ("wandb", "wandb", "wandb")])
def test_missing_extra_gives_an_install_hint(monkeypatch, tmp_path, module, source, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a package that is not installed
    with pytest.raises(CartridgeError) as e:
        fetch(source, "s3://b/k.pt" if source == "s3" else "org/name", cache_dir=tmp_path)
    assert e.value.field == "source" and f"final[{extra}]" in str(e.value) and module in str(e.value)


def test_wandb_picks_the_latest_cache_file():
    names = ["config.yaml", "cache-step100.pt", "cache-step2000.pt", "cache-epoch3.pt", "cache-step999.pt"]
    assert latest_wandb_cache_file(names) == "cache-step2000.pt"
    assert latest_wandb_cache_file(["cache_last.pt", "output.log"]) == "cache_last.pt"
    assert latest_wandb_cache_file(["output.log"]) is None
