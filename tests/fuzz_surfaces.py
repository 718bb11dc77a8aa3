"""Generated malformed requests for tests/test_fuzz_surfaces.py: for a route, every way its body can be wrong that
can be derived from its model (final.protocol.bodies, the weights route's) - each field given each JSON type it
does not take, non-finite and huge numbers, a required field dropped, unknown fields - plus bodies that are not
JSON objects, bad encodings, sizes past the limit, wrong content types and methods, and the route's own names
(cartridge specs, weight paths). Every case must get a typed 4xx. Tool fields (tools, tool_choice,
response_format, ...) are fuzzed with the tools, not here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from pydantic import BaseModel

# one value of each JSON type (several per type: an edge and a plain one)
SAMPLES: list[tuple[str, Any]] = [("string", "x"), ("string", ""), ("integer", 7), ("integer", -3), ("number", 2.5),
                                  ("boolean", True), ("boolean", False), ("array", []), ("array", [1, "a"]),
                                  ("object", {}), ("object", {"k": 1}), ("null", None)]
NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e400"]
TOOL_FIELDS = {"tools", "tool_choice", "response_format", "parallel_tool_calls", "functions", "function_call",
               "tool_calls", "tool_call_id", "chat_template_kwargs"}
UNKNOWN = ["bogus", "Model", "__proto__", "", "max_tokens ", "logit_bias_"]


@dataclass
class Case:
    name: str
    body: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    param: str | None = None  # the field the error must name (None: not checked)
    path: str | None = None  # another route than the surface's own


def _types(schema: dict, defs: dict) -> set[str]:
    """JSON types a property's schema takes (strict pydantic: an integer is also a number)."""
    if "$ref" in schema:
        return _types(defs[schema["$ref"].split("/")[-1]], defs)
    if "anyOf" in schema or "oneOf" in schema:
        return set().union(*(_types(s, defs) for s in schema.get("anyOf") or schema["oneOf"]))
    if "enum" in schema or "const" in schema:
        values = schema.get("enum") or [schema.get("const")]
        return {_json_type(v) for v in values}
    kind = schema.get("type")
    if kind is None:
        return {"string", "integer", "number", "boolean", "array", "object", "null"}  # Any
    kinds = set(kind) if isinstance(kind, list) else {kind}
    return kinds | ({"integer"} if "number" in kinds else set())


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}[type(value)]


def _dump(body: Any) -> bytes:
    return json.dumps(body).encode()


def _at(body: dict, path: list, value: Any, drop: bool = False) -> dict:
    """A deep copy of body with the field at `path` (keys and list indices) set to value (or dropped)."""
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    if drop:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def field_cases(model: type[BaseModel], good: dict, prefix: list | None = None) -> Iterator[Case]:
    """Each field of `model` (as present in the good body `good`, nested objects and the first item of arrays of
    objects included) given every JSON type it does not take, non-finite and huge numbers where it takes numbers;
    each required field dropped; unknown fields added."""
    schema = model.model_json_schema()
    yield from _object_cases(schema, schema.get("$defs", {}), good, prefix or [])


def _object_cases(schema: dict, defs: dict, good: dict, path: list) -> Iterator[Case]:
    node = good
    for key in path:
        node = node[key]
    where = ".".join(map(str, path))
    for name, prop in schema.get("properties", {}).items():
        if name in TOOL_FIELDS:
            continue
        param = ".".join(map(str, path + [name]))
        takes = _types(prop, defs)
        for kind, value in SAMPLES:
            if kind not in takes:
                yield Case(f"{param}={kind}:{json.dumps(value)}", _dump(_at(good, path + [name], value)), param=param)
        if takes & {"number", "integer"}:
            marker = 1234567.25
            text = _dump(_at(good, path + [name], marker))
            for raw in NON_FINITE:
                yield Case(f"{param}={raw.decode()}", text.replace(b"1234567.25", raw))
        if "integer" in takes and "number" not in takes:
            yield Case(f"{param}=huge", _dump(_at(good, path + [name], 10**40)), param=param)
        sub = _object_schema(prop, defs)
        if sub is not None and isinstance(node.get(name), dict):
            yield from _object_cases(sub, defs, good, path + [name])
        items = _object_schema(prop.get("items", {}), defs) if prop.get("type") == "array" else None
        if items is not None and isinstance(node.get(name), list) and node[name] and isinstance(node[name][0], dict):
            yield from _object_cases(items, defs, good, path + [name, 0])
    for name in schema.get("required", []):
        if name in node:
            yield Case(f"{where or 'body'}: without {name}", _dump(_at(good, path + [name], None, drop=True)))
    for name in UNKNOWN:
        yield Case(f"{where or 'body'}: unknown field {name!r}", _dump(_at(good, path + [name], 1)))


def _object_schema(prop: dict, defs: dict) -> dict | None:
    """The object schema a property holds (directly, by $ref, or as the non-null member of an Optional)."""
    if "$ref" in prop:
        return defs[prop["$ref"].split("/")[-1]]
    for member in prop.get("anyOf", []):
        found = _object_schema(member, defs)
        if found is not None:
            return found
    return prop if prop.get("type") == "object" and "properties" in prop else None


def raw_cases(good: dict, max_body_bytes: int) -> Iterator[Case]:
    """Bodies that are not one JSON object, bad encodings, sizes past the limit, content types that are not JSON."""
    text = _dump(good)
    for i, raw in enumerate([b"", b"   \n", b"{", b"}", b"[]", b"[" + text + b"]", b"null", b"42", b'"text"', b"true",
                             text[:-1], text[: len(text) // 2], text + b"x", text + text, b"{'model': 'm'}",
                             b"{\"model\": \"m\",}", b"\x00" + text, text.replace(b"{", b"{\x00", 1),
                             b"\xff\xfe" + text, b"\xef\xbb\xbf" + text, text.decode().encode("utf-16"),
                             text.replace(b"\"m\"", b"\"\xff\xfe\""), text.replace(b"\"m\"", b"\"\\ud800\""),
                             b"[" * 50000 + b"]" * 50000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                             b'{"model": ' + b"9" * 5000 + b"}"]):
        yield Case(f"raw-{i}", raw)
    yield Case("body past the limit", _dump({**good, "user": "u" * (max_body_bytes + 10)}))
    yield Case("body past the limit, no length", (b" " * 8192 for _ in range(max_body_bytes // 8192 + 2)),
               headers={"content-type": "application/json"})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/xml", "image/png", "application/octet-stream"):
        yield Case(f"content-type {kind}", text, headers={"content-type": kind}, param="content-type")
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        yield Case(f"method {method}", text if method != "GET" else None, method=method)


def method_cases(path: str) -> Iterator[Case]:
    """A GET route asked with the methods it does not serve."""
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        yield Case(f"{method} {path}", b"{}", method=method, path=path)
