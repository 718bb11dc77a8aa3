"""Cartridge files: the HazyResearch `.pt` layout and a `.safetensors` twin, loaded without running pickled code.

A cartridge is per-layer K/V of shape [1, H_kv, T, D] (keys post-RoPE), stored as a frozen part and a trainable
part (older files say `fixed_*` for frozen); the full cartridge is cat(frozen, trainable) on the token axis.
`.pt` files are read with `torch.load(weights_only=True)` and only `nn.ParameterList` allow-listed, so a file
that would execute code is refused. `.safetensors` files hold `trainable_keys.{i}` etc., the names a
ParameterList's state_dict would use.
"""

from __future__ import annotations

import pickle
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from final.errors import CartridgeError

PARTS = ("frozen_keys", "frozen_values", "trainable_keys", "trainable_values")
LEGACY = {"fixed_keys": "frozen_keys", "fixed_values": "frozen_values"}
_SAFE_NAME = re.compile(r"^(trainable_keys|trainable_values|frozen_keys|frozen_values|fixed_keys|fixed_values)\.(\d+)$")


@dataclass
class CartridgeKV:
    """A whole cartridge in memory: per-layer keys/values [1, H_kv, T, D], the first `num_frozen_tokens` frozen."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    num_frozen_tokens: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def to(self, dtype: torch.dtype) -> "CartridgeKV":
        return CartridgeKV([k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values], self.num_frozen_tokens)

    def split(self) -> dict[str, list[torch.Tensor]]:
        """The four stored parts (frozen first, as the cartridges repo's TrainableCache keeps them)."""
        f = self.num_frozen_tokens
        frozen = lambda ts: [t[:, :, :f].contiguous() for t in ts] if f else []  # noqa: E731
        trainable = lambda ts: [t[:, :, f:].contiguous() for t in ts]  # noqa: E731
        return {"frozen_keys": frozen(self.keys), "frozen_values": frozen(self.values),
                "trainable_keys": trainable(self.keys), "trainable_values": trainable(self.values)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- loading ---------------------------------------------------------------------------------------------
def load_cartridge(path: str | Path, *, allow_nonfinite: bool = False) -> CartridgeKV:
    """Read a `.pt` or `.safetensors` cartridge (by content, not extension) and validate its structure."""
    path = Path(path).expanduser()
    name = str(path)
    head, size = _head(path)
    if _looks_like_safetensors(head, size):
        parts, _meta = _read_safetensors(path)
    else:
        parts = _read_pt(path, head)
    return assemble(parts, name, allow_nonfinite=allow_nonfinite)


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= size - 8 and head[8:9] == b"{"


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    from safetensors import SafetensorError, safe_open

    name = str(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CartridgeError(f"unreadable safetensors file (truncated or corrupt): {exc}", file=name,
                             field="file") from None
    indexed: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _SAFE_NAME.match(key)
        if not m:
            raise CartridgeError(f"unexpected tensor {key!r}; expected names like trainable_keys.0", file=name,
                                 field=key)
        indexed.setdefault(m.group(1), {})[int(m.group(2))] = tensor
    parts: dict[str, list] = {}
    for part, layers in indexed.items():
        missing = sorted(set(range(max(layers) + 1)) - set(layers))
        if missing:
            raise CartridgeError(f"layers {missing} are missing", file=name, field=part)
        parts[part] = [layers[i] for i in range(len(layers))]
    return parts, meta


_PARAMETER_LIST = f"{nn.ParameterList.__module__}.{nn.ParameterList.__qualname__}"


def _allow_parameter_list() -> None:
    # Checked on every load, not once: any other code's `with torch.serialization.safe_globals([ParameterList])`
    # removes the class from the process-wide set when its block ends (torch removes what the block named, even
    # if it was there before), and a once-per-process flag then refused every later cartridge in the process.
    if nn.ParameterList not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([nn.ParameterList])


def _load_weights_only(path: Path):
    """torch.load(weights_only) with ParameterList allowed; retried once if another thread's safe_globals()
    block removed the class between our check and the unpickle (the refusal then names ParameterList)."""
    for attempt in (0, 1):
        _allow_parameter_list()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if attempt or f"GLOBAL {_PARAMETER_LIST}" not in str(exc):
                raise


def read_pt(path: str | Path) -> dict:
    """A torch file's top-level dict as a cartridge's is read (weights_only: tensors, containers and ParameterList
    only; every failure a CartridgeError naming the file) - also for files beside cartridges, such as a training
    checkpoint, that come from the same untrusted places."""
    path = Path(path).expanduser()
    return _read_pt(path, _head(path)[0])


def _head(path: Path) -> tuple[bytes, int]:
    """The file's first 16 bytes and its size, after the checks every read makes (exists, a regular file, not empty)."""
    name = str(path)
    if not path.exists():
        raise CartridgeError("file does not exist", file=name, field="path")
    if not path.is_file():
        raise CartridgeError("is not a regular file", file=name, field="path")
    size = path.stat().st_size
    if size == 0:
        raise CartridgeError("file is empty", file=name, field="file")
    with open(path, "rb") as fh:
        return fh.read(16), size


def _read_pt(path: Path, head: bytes) -> dict:
    from safetensors import SafetensorError  # torch >= 2.10 hands a *.safetensors name to safetensors itself

    name = str(path)
    if head[:2] == b"PK" and not zipfile.is_zipfile(path):
        raise CartridgeError("torch zip archive is truncated or corrupt", file=name, field="file")
    try:
        # Only tensors, containers and ParameterList may be rebuilt: anything naming another global is refused
        # before it runs, so a malicious pickle never executes.
        # The allow-list is process-wide and never scoped to a `with` block here: a scoped block's exit removes the
        # class while other threads (final serve loads request cartridges on a thread pool) are mid-load.
        obj = _load_weights_only(path)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        m = re.search(r"GLOBAL ([\w.]+)", text)
        if m:
            raise CartridgeError(f"refused to unpickle {m.group(1)}: cartridge files may contain only tensors "
                                 "(this file would run code when loaded)", file=name, field="pickle") from None
        if head[:2] == b"PK" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
            detail = text.split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:200]
            raise CartridgeError(f"refused: the pickle holds more than tensors ({detail})", file=name,
                                 field="pickle") from None
        raise CartridgeError("not a cartridge file (.pt or .safetensors)", file=name, field="file") from None
    except (RuntimeError, EOFError, ValueError, OSError, struct.error, KeyError, IndexError, SafetensorError) as exc:
        raise CartridgeError(f"not a readable cartridge file (truncated, corrupt or not .pt/.safetensors): "
                             f"{type(exc).__name__}: {str(exc)[:200]}", file=name, field="file") from None
    if not isinstance(obj, dict):
        raise CartridgeError(f"top level is {type(obj).__name__}, expected a dict of {', '.join(PARTS)}",
                             file=name, field="file")
    return obj


def assemble(obj: dict, name: str, *, allow_nonfinite: bool = False) -> CartridgeKV:
    """Validate the four parts (any of list / ParameterList / None for frozen) and concatenate them."""
    obj = {LEGACY.get(k, k): v for k, v in obj.items()}
    for key in ("trainable_keys", "trainable_values"):
        if key not in obj:
            hint = ("; this is a training checkpoint: `final cartridge eval --checkpoint` asks its cartridge"
                    if {"cache", "history"} <= set(obj) else "")
            raise CartridgeError(f"missing key {key!r} (found {sorted(obj)}){hint}", file=name, field=key)
    if ("frozen_keys" in obj) != ("frozen_values" in obj):
        have, lack = ("frozen_keys", "frozen_values") if "frozen_keys" in obj else ("frozen_values", "frozen_keys")
        raise CartridgeError(f"has {have!r} but not {lack!r}", file=name, field=lack)
    parts = {key: _layers(obj.get(key), key, name) for key in PARTS}
    tk, tv, fk, fv = parts["trainable_keys"], parts["trainable_values"], parts["frozen_keys"], parts["frozen_values"]
    n = len(tk)
    if n == 0:
        raise CartridgeError("has no layers", file=name, field="trainable_keys")
    if len(tv) != n:
        raise CartridgeError(f"K/V layer count mismatch: {n} key layers, {len(tv)} value layers", file=name,
                             field="trainable_values")
    if len(fk) != len(fv) or (fk and len(fk) != n):
        raise CartridgeError(f"frozen part has {len(fk)} key / {len(fv)} value layers, trainable has {n}",
                             file=name, field="frozen_keys" if len(fk) != n else "frozen_values")
    ref = tk[0]
    if not isinstance(ref, torch.Tensor) or ref.dim() != 4:
        raise CartridgeError("is not a 4-D tensor [1, num_kv_heads, num_tokens, head_dim]", file=name,
                             field="trainable_keys[0]")
    for key, layers in parts.items():
        for i, t in enumerate(layers):
            _check_tensor(t, ref, f"{key}[{i}]", name, key.startswith("frozen"), allow_nonfinite)
    if fk and any(a.shape != fk[0].shape for a in fk + fv):
        raise CartridgeError("frozen K/V shapes differ across layers", file=name, field="frozen_keys")
    frozen = fk[0].shape[2] if fk else 0
    keys = [torch.cat([f, t], dim=2) if frozen else t for f, t in zip(fk or [None] * n, tk)]
    values = [torch.cat([f, t], dim=2) if frozen else t for f, t in zip(fv or [None] * n, tv)]
    if keys[0].shape[2] == 0:
        raise CartridgeError("has zero tokens", file=name, field="num_tokens")
    return CartridgeKV([k.contiguous() for k in keys], [v.contiguous() for v in values], frozen)


def _layers(value, key: str, name: str) -> list:
    if value is None:
        return []
    if isinstance(value, (nn.ParameterList, list, tuple)):
        return [p.detach() if isinstance(p, torch.Tensor) else p for p in value]
    raise CartridgeError(f"is {type(value).__name__}, expected a list or nn.ParameterList of per-layer tensors",
                         file=name, field=key)


def _check_tensor(t, ref: torch.Tensor, field: str, name: str, frozen: bool, allow_nonfinite: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise CartridgeError(f"is {type(t).__name__}, not a tensor", file=name, field=field)
    if t.dim() != 4 or t.shape[0] != 1:
        raise CartridgeError(f"has shape {list(t.shape)}, expected [1, num_kv_heads, num_tokens, head_dim]",
                             file=name, field=field)
    if not t.dtype.is_floating_point or t.dtype != ref.dtype:
        raise CartridgeError(f"has dtype {dtype_name(t.dtype)}, expected the floating dtype of trainable_keys[0] "
                             f"({dtype_name(ref.dtype)})", file=name, field=field)
    same = (t.shape[1], t.shape[3]) == (ref.shape[1], ref.shape[3]) if frozen else t.shape == ref.shape
    if not same:
        raise CartridgeError(f"shape mismatch across layers: {list(t.shape)} vs trainable_keys[0] "
                             f"{list(ref.shape)}", file=name, field=field)
    if not allow_nonfinite and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CartridgeError(f"contains {bad} NaN/Inf values (pass allow_nonfinite=True to accept)", file=name,
                             field=field)


# ---- saving ----------------------------------------------------------------------------------------------
def save_cartridge(cart: CartridgeKV, path: str | Path) -> Path:
    """Write `.safetensors` if the name ends so, else the cartridges repo's `.pt` layout (ParameterLists)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = cart.split()
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        tensors = {f"{key}.{i}": t for key, layers in parts.items() for i, t in enumerate(layers)}
        save_file(tensors, str(tmp), metadata={"format": "cartridge", "num_frozen_tokens": str(cart.num_frozen_tokens)})
    else:
        # As TrainableCache.save: ParameterLists of Parameters under the repo's names (its from_pretrained reads
        # fixed_keys/fixed_values, and refuses a file without them); frozen ones do not require grad.
        repo_name = {v: k for k, v in LEGACY.items()}
        obj = {repo_name.get(key, key): nn.ParameterList([nn.Parameter(t, requires_grad=not key.startswith("frozen"))
                                                          for t in layers]) for key, layers in parts.items()}
        torch.save(obj, tmp)
    tmp.replace(path)
    return path
