"""The JSON manifest kept beside a cartridge file, its checksum, and validation against the serving model.

A cartridge file carries no metadata, so `<file>.manifest.json` records what it is (shape, dtype, tokens), which
model it belongs to and its sha256. Everything here runs before the engine is touched; the engine's own shape
checks stay as the last line.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from final.cartridges.format import CartridgeKV, dtype_name
from final.cartridges.positions import DEFAULT_POSITIONS, check_positions
from final.errors import CartridgeError

logger = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".manifest.json"


@dataclass
class CartridgeManifest:
    cartridge_id: str
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    num_frozen_tokens: int
    sha256: str
    size: int
    created_at: str = ""
    source_document: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # where the tokens after the cartridge were during training (final.cartridges.positions): after_prefix (at p,
    # June 2025 cartridges code, Tokasaurus, final) or from_zero (at 0, the cartridges repo's later packed training);
    # None (older manifests): not stated, so the run's config.yaml or the default (after_prefix) decides
    positions: str | None = None

    @classmethod
    def describe(cls, cart: CartridgeKV, file: str | Path, *, cartridge_id: str, model_id: str = "",
                 source_document: str | None = None, labels: dict[str, str] | None = None,
                 positions: str = DEFAULT_POSITIONS) -> "CartridgeManifest":
        """A manifest for `cart` as saved at `file` (reads the file for its size and checksum)."""
        path = Path(file)
        return cls(cartridge_id=cartridge_id, model_id=model_id, num_layers=cart.num_layers,
                   num_kv_heads=cart.num_kv_heads, head_dim=cart.head_dim, dtype=dtype_name(cart.dtype),
                   num_tokens=cart.num_tokens, num_frozen_tokens=cart.num_frozen_tokens, sha256=sha256_file(path),
                   size=path.stat().st_size, created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                   source_document=source_document, labels=dict(labels or {}),
                   positions=check_positions(positions, field="positions"))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def write(self, cartridge_file: str | Path) -> Path:
        out = manifest_path(cartridge_file)
        out.write_text(self.to_json())
        return out


def manifest_path(cartridge_file: str | Path) -> Path:
    p = Path(cartridge_file)
    return p.with_name(p.name + MANIFEST_SUFFIX)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_TYPES: dict[str, tuple[type, ...]] = {
    "cartridge_id": (str,), "model_id": (str,), "num_layers": (int,), "num_kv_heads": (int,), "head_dim": (int,),
    "dtype": (str,), "num_tokens": (int,), "num_frozen_tokens": (int,), "sha256": (str,), "size": (int,),
    "created_at": (str,), "source_document": (str, type(None)), "labels": (dict,), "positions": (str, type(None)),
}
_REQUIRED = ("cartridge_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "num_tokens", "sha256", "size")


def read_manifest(path: str | Path) -> CartridgeManifest:
    """Parse and type-check a manifest file; every problem names the file and the field."""
    name = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise CartridgeError(f"cannot read manifest: {exc}", file=name, field="manifest") from None
    except json.JSONDecodeError as exc:
        raise CartridgeError(f"manifest is not valid JSON: {exc}", file=name, field="manifest") from None
    if not isinstance(data, dict):
        raise CartridgeError("manifest must be a JSON object", file=name, field="manifest")
    for key in _REQUIRED:
        if key not in data:
            raise CartridgeError("missing from the manifest", file=name, field=key)
    unknown = sorted(set(data) - set(_TYPES))
    if unknown:
        logger.warning("manifest %s: ignoring unknown fields %s", name, unknown)
    values: dict[str, Any] = {}
    for f in fields(CartridgeManifest):
        if f.name not in data:
            continue
        value = data[f.name]
        kinds = _TYPES[f.name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise CartridgeError(f"has type {type(value).__name__}, expected {' or '.join(k.__name__ for k in kinds)}",
                                 file=name, field=f.name)
        if kinds == (int,) and value < (1 if f.name != "num_frozen_tokens" else 0):
            raise CartridgeError(f"must be positive, got {value}", file=name, field=f.name)
        values[f.name] = value
    if len(values["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in values["sha256"].lower()):
        raise CartridgeError("must be 64 hex digits", file=name, field="sha256")
    values.setdefault("model_id", "")
    values.setdefault("num_frozen_tokens", 0)
    if values.get("positions") is not None:
        check_positions(values["positions"], file=name)
    return CartridgeManifest(**values)


def verify_checksum(cartridge_file: str | Path, manifest: CartridgeManifest) -> None:
    """Size first (cheap, catches truncation), then sha256."""
    name = str(cartridge_file)
    size = Path(cartridge_file).stat().st_size
    if size != manifest.size:
        raise CartridgeError(f"file has {size} bytes, the manifest says {manifest.size} (truncated or replaced?)",
                             file=name, field="size")
    digest = sha256_file(cartridge_file)
    if digest != manifest.sha256.lower():
        raise CartridgeError(f"checksum mismatch: sha256 {digest} != manifest {manifest.sha256}", file=name,
                             field="sha256")


def check_matches_manifest(cart: CartridgeKV, manifest: CartridgeManifest, name: str) -> None:
    """The tensors must be what the manifest says they are."""
    actual = {"num_layers": cart.num_layers, "num_kv_heads": cart.num_kv_heads, "head_dim": cart.head_dim,
              "num_tokens": cart.num_tokens, "num_frozen_tokens": cart.num_frozen_tokens,
              "dtype": dtype_name(cart.dtype)}
    for key, value in actual.items():
        if getattr(manifest, key) != value:
            raise CartridgeError(f"manifest says {getattr(manifest, key)!r}, the file has {value!r}", file=name,
                                 field=key)


@dataclass(frozen=True)
class ModelShape:
    """What a cartridge must match: the model's KV geometry and context window."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    @classmethod
    def of(cls, model: Any) -> "ModelShape":
        """From a ModelShape, final.engine.model.ModelSpec, an HF config (object or dict) or a model folder."""
        if isinstance(model, cls):
            return model
        if isinstance(model, (str, Path)):
            config = Path(model) / "config.json"
            if not config.exists():
                raise CartridgeError(f"no config.json in {model}", field="model")
            model = json.loads(config.read_text())
        get = (lambda k: model.get(k)) if isinstance(model, dict) else (lambda k: getattr(model, k, None))
        if get("num_layers") is not None:  # ModelSpec
            return cls(get("num_layers"), get("num_kv_heads"), get("head_dim"), get("max_position_embeddings"))
        cfg = get("text_config") or model  # multimodal configs nest the language model's
        get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        return cls(get("num_hidden_layers"), get("num_key_value_heads") or heads, head_dim,
                   get("max_position_embeddings") or 1 << 62)


def check_matches_model(cart: CartridgeKV, model: ModelShape, name: str) -> None:
    for key in ("num_layers", "num_kv_heads", "head_dim"):
        have, want = getattr(cart, key), getattr(model, key)
        if have != want:
            raise CartridgeError(f"cartridge has {key}={have}, the model has {want}", file=name, field=key)
    if cart.num_tokens >= model.max_context:
        raise CartridgeError(f"{cart.num_tokens} tokens leave no room for a prompt in the model's context of "
                             f"{model.max_context}", file=name, field="num_tokens")
