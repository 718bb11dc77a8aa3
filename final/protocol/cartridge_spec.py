"""A cartridge spec (`{id, source, force_redownload, ...}`) and the name in it, checked in one place for every
caller: the config's `cartridges`, the tokasaurus backend's and veRL replica's settings, `generate(cartridge=...)`,
`load_cartridge`, and `final serve`'s bodies and `<cartridge>` blocks. The checks run before a name reaches the
filesystem or a download, so a name the OS cannot take is a typed error naming the field (HTTP 400), never an
OSError or ValueError from `stat` (which the server could only answer with a 500).

A name (`id` or `path`) is a non-blank string of at most MAX_NAME_BYTES bytes in UTF-8 (a path: MAX_PATH_BYTES),
each part between slashes at most MAX_PART_BYTES (Linux's NAME_MAX), with no control character (C0, DEL, C1: NUL
among them) and no lone surrogate (it has no UTF-8 form). Where a name may lead (`../`, absolute paths) is the
caller's rule: `final serve` keeps local files under --cartridge-dir (final/server/prepare.py).
"""

from __future__ import annotations

import difflib
import unicodedata
from typing import Any

from final.errors import CartridgeError, ConfigError
from final.protocol.bodies import CARTRIDGE_POSITIONS, CARTRIDGE_SOURCES, WIRE_CARTRIDGE_KEYS

# a config's spec: the wire's plus a local path and pinning (the wire's `positions` is ours too: see bodies.py)
CARTRIDGE_KEYS = tuple(dict.fromkeys(WIRE_CARTRIDGE_KEYS + ("positions", "path", "pin")))
REQUEST_CARTRIDGE_KEYS = CARTRIDGE_KEYS + ("allow_nonfinite",)  # a request's may also accept non-finite values
MAX_NAME_BYTES = 1024  # a whole id (W&B's entity/project/run/file and S3 keys fit with room to spare)
MAX_PART_BYTES = 255  # one part between slashes: the longest file name Linux (and macOS) allow
# a `path` may be a server's own: --cartridge-dir joined with an id, longer than any id (Linux's PATH_MAX less the NUL)
MAX_PATH_BYTES = 4095
LIMITS = {"id": MAX_NAME_BYTES, "path": MAX_PATH_BYTES}


def name_problem(value: Any, max_bytes: int = MAX_NAME_BYTES) -> str | None:
    """Why `value` cannot name a cartridge, or None when it can."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value.strip():
        return "must be a non-empty string"
    for i, ch in enumerate(value):
        kind = unicodedata.category(ch)
        if kind == "Cc":
            return f"holds the control character U+{ord(ch):04X} at position {i}"
        if kind == "Cs":
            return f"holds a lone surrogate U+{ord(ch):04X} at position {i} (not valid Unicode text)"
    size = len(value.encode())
    if size > max_bytes:
        return f"is {size} bytes long (UTF-8); at most {max_bytes}"
    part = max(value.split("/"), key=lambda p: len(p.encode()))
    if len(part.encode()) > MAX_PART_BYTES:
        return f"has a part between slashes {len(part.encode())} bytes long (UTF-8); at most {MAX_PART_BYTES}"
    return None


def shown(value: Any, limit: int = 60) -> str:
    """A name as an error message quotes it: repr'd (control characters visible) and cut, never 5,000 characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...'"


def check_cartridge_name(value: Any, field: str) -> str:
    """A name given outside a spec (an id passed to generate() or load_cartridge): CartridgeError naming `field`
    (a "path" field may be as long as the OS allows a path; any other is an id)."""
    problem = name_problem(value, LIMITS.get(field, MAX_NAME_BYTES))
    if problem is not None:
        raise CartridgeError(f"{shown(value)} {problem}", field=field)
    return value


def check_cartridge_specs(value: Any, path: str | None, where: str = "cartridges",
                          keys: tuple[str, ...] = CARTRIDGE_KEYS, fill_defaults: bool = True) -> list[dict]:
    """A list of cartridge specs ({id, source, force_redownload, ...}) in a config, each key checked.

    fill_defaults adds source=local and force_redownload=false; without it specs are kept as written (the
    tokasaurus backend sends them on, and Tokasaurus has defaults of its own)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"must be a list of {{{', '.join(keys)}}}", key=where, path=path)
    out = [check_cartridge_spec(item, f"{where}[{i}]", keys, path=path) for i, item in enumerate(value)]
    return [{"source": "local", "force_redownload": False, **item} for item in out] if fill_defaults else out


def check_cartridge_spec(item: Any, at: str, keys: tuple[str, ...], *, path: str | None = None,
                         request: bool = False) -> dict:
    """One cartridge spec: the rules of the config, the tokasaurus backend and requests (CartridgeService).
    A config's spec needs an id; a request's may give a path instead. Errors: ConfigError naming the key path,
    or for a request (request=True) CartridgeError naming the field."""
    def error(message: str, key: str) -> Exception:
        return CartridgeError(message, field=key) if request else ConfigError(message, key=key, path=path)

    if not isinstance(item, dict):
        raise error(f"must be a mapping with id and source, got {type(item).__name__}", at)
    for key in item:
        if key not in keys:
            near = difflib.get_close_matches(str(key), list(keys), n=1)
            raise error(f"unknown key; {f'did you mean {near[0]!r}?' if near else 'valid keys: ' + ', '.join(keys)}",
                        f"{at}.{key if isinstance(key, str) and len(key) <= 40 else shown(key, 40)}")
    for key in ("id", "path"):
        problem = name_problem(item[key], LIMITS[key]) if item.get(key) is not None else None
        if problem is not None:
            raise error(f"{shown(item[key])} {problem}" if isinstance(item[key], str) else problem, f"{at}.{key}")
    if not item.get("id") and not (request and item.get("path")):
        raise error("is required (a non-empty string)", f"{at}.id")
    for key, choices in (("source", CARTRIDGE_SOURCES), ("positions", CARTRIDGE_POSITIONS)):
        if key in item and item[key] not in choices:
            raise error(f"must be one of {', '.join(choices)}, got {shown(item[key])}", f"{at}.{key}")
    for key in ("force_redownload", "pin", "allow_nonfinite"):
        if key in item and not isinstance(item[key], bool):
            raise error(f"must be true or false, got {shown(item[key])}", f"{at}.{key}")
    return dict(item)
