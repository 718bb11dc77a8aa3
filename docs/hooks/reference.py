"""MkDocs hook: the reference pages' tables are generated from the code at build time, so they cannot drift.

A page holds a marker, `<!-- generated: NAME -->`, and the build replaces it with:
- `cli`: every `final` subcommand, from final.cli.build_parser() (argparse: usage, help, each option);
- `config`: the config schema, from final/config.py (top-level keys, our `rollout:` defaults, veRL's RolloutConfig
  fields, `engine_kwargs.local`) and final/sampling.py's `Limits` (each key's default and its comment);
- `http`: `final serve`'s routes, from the app final/server/app.py builds, with each POST route's body fields
  (final/protocol/bodies.py).
A marker with no generator fails the build (mkdocs build --strict turns the warning into an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import logging
import re
import tokenize
from types import SimpleNamespace

log = logging.getLogger("mkdocs.plugins.final_reference")
MARKER = re.compile(r"<!-- generated: (\w+) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    def render(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            log.warning("%s: no generator for marker '%s'", page.file.src_path, name)
            return match.group(0)
        return GENERATORS[name]()

    return MARKER.sub(render, markdown)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---- the CLI ---------------------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, depth first (`cartridge build` under `cartridge`)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name) or "", sub))
                found += [(f"{name} {n}", h, p) for n, h, p in _subparsers(sub)]
    return found


def _options_table(parser: argparse.ArgumentParser) -> str:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        default = "" if action.default in (None, argparse.SUPPRESS, False) or action.option_strings == [] \
            else f"`{action.default}`"
        rows.append(f"| {names} | {default} | {_cell(action.help or '')} |")
    if not rows:
        return ""
    return "| argument | default | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def cli_reference() -> str:
    from final.cli import build_parser

    parser = build_parser()
    out = [f"```\n{parser.format_usage().strip()}\n```\n"]
    for name, help_text, sub in _subparsers(parser):
        sub.prog = f"final {name}"
        out.append(f"## `final {name}`\n\n{help_text}\n\n```\n{sub.format_usage().strip()}\n```\n")
        if sub.description:
            out.append(sub.description.strip() + "\n")
        out.append(_options_table(sub))
    return "\n".join(out)


# ---- the config schema ------------------------------------------------------------------------------------------


def _field_comments(cls: type) -> dict[str, str]:
    """A dataclass's `name: type = default  # comment` comments, read from its source."""
    source = inspect.getsource(cls)
    comments, last_name = {}, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and last_name is None:
            last_name = tok.string
        elif tok.type == tokenize.COMMENT and last_name:
            comments[last_name] = tok.string.lstrip("# ").strip()
        if tok.type == tokenize.NEWLINE:
            last_name = None
    return comments


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def config_reference() -> str:
    from verl.workers.config import RolloutConfig

    from final import config
    from final.sampling import Limits

    top = {f.name: f for f in dataclasses.fields(config.EngineConfig)}
    notes = _field_comments(config.EngineConfig)
    out = ["### Top-level keys\n", "| key | default | note |", "|---|---|---|"]
    for key in config.TOP_LEVEL:
        f = top.get(key)
        out.append(f"| `{key}` | {_default(f) if f else ''} | {_cell(notes.get(key, ''))} |")
    out += ["", "### `limits:`\n", "| key | default | note |", "|---|---|---|"]
    notes = _field_comments(Limits)
    for f in dataclasses.fields(Limits):
        out.append(f"| `{f.name}` | {_default(f)} | {_cell(notes.get(f.name, ''))} |")
    out += ["", "### `rollout:` (veRL's `RolloutConfig`, field for field)\n",
            f"Backends (`rollout.name`): {', '.join(f'`{b}`' for b in config.BACKENDS)}. Defaults are final's where "
            "it sets one, else veRL's.\n", "| key | default |", "|---|---|"]
    for f in dataclasses.fields(RolloutConfig):
        if f.name.startswith("_"):
            continue
        ours = config.ROLLOUT_DEFAULTS.get(f.name, dataclasses.MISSING)
        default = f"`{ours!r}` (final's)" if ours is not dataclasses.MISSING else _default(f)
        out.append(f"| `rollout.{f.name}` | {_cell(default)} |")
    out += ["", "### `rollout.multi_turn`: final's keys beside veRL's `MultiTurnConfig`\n",
            "| key | type | default |", "|---|---|---|"]
    out += [f"| `rollout.multi_turn.{k}` | `{t.__name__}` | `{d!r}` |" for k, (t, d) in config.MULTI_TURN_KEYS.items()]
    out += ["", "### `rollout.engine_kwargs.local` (the embedded engine)\n", "| key | type |", "|---|---|"]
    out += [f"| `{k}` | `{t.__name__}` |" for k, t in config.LOCAL_ENGINE_KEYS.items()]
    out.append(f"\n`quantization`: {', '.join(f'`{q}`' for q in config.LOCAL_QUANTIZATIONS)} or null.\n")
    return "\n".join(out)


# ---- the HTTP routes --------------------------------------------------------------------------------------------


def http_reference() -> str:
    from fastapi.routing import APIRoute

    from final.config import load_config
    from final.server.app import ROUTES, create_app

    # create_app reads only the engine's config and tokenizer while building routes; nothing is served here
    stand_in = SimpleNamespace(config=load_config(None), tokenizer=None)
    app = create_app(stand_in)
    out = ["| method | route | body fields |", "|---|---|---|"]
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        body = ROUTES.get(route.path, (None,))[0]
        fields = ", ".join(f"`{n}`" for n in body.model_fields) if body is not None else ""
        out.append(f"| {' '.join(sorted(route.methods))} | `{route.path}` | {fields} |")
    return "\n".join(out) + "\n"


GENERATORS = {"cli": cli_reference, "config": config_reference, "http": http_reference}


# ---- the benchmarks dashboard -----------------------------------------------------------------------------------


def results_dashboard() -> str:
    """bench/RESULTS.md's dashboard: the lines between its `dashboard` markers (one source for both pages)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "bench" / "RESULTS.md").read_text()
    start, end = "<!-- dashboard: start -->", "<!-- dashboard: end -->"
    if start not in text or end not in text:
        log.warning("bench/RESULTS.md has no %s ... %s block", start, end)
        return ""
    return text.split(start, 1)[1].split(end, 1)[0].strip() + "\n"


GENERATORS["results"] = results_dashboard
