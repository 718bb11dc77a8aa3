"""The one JSON Schema check a tool's parameters pass, wherever they are written: tools.yaml (final.tools.registry)
or a request's tools (final.tools.spec). Each caller raises its own typed error from what this returns."""

from __future__ import annotations

from jsonschema import Draft202012Validator, SchemaError


def schema_problem(schema: dict) -> tuple[str, str] | None:
    """Why `schema` is not a valid JSON Schema (the 2020-12 metaschema), and the dotted path inside it where
    ("" at its top); None when it is one."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"is not a valid JSON Schema: {exc.message[:200]}", ".".join(str(p) for p in exc.path)
    except RecursionError:
        return "is nested too deeply", ""
    return None
