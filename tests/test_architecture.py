"""The shape of the package: imports point one way, backends are reached only through their declared interface,
functions and files stay small. These read the source; they run nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "final"

# Lowest first. A module may import its own layer and the layers below, never one above.
# tools/ (tool-call parsing, tools.yaml, guarded execution) needs only core, and the rollout's multi-turn path
# runs it, so it sits below rollout, as verl.tools sits below verl.workers.rollout.
LAYERS = [
    ("core", {"errors", "compat", "config", "models", "prompts", "sampling", "outputs", "request", "protocol",
              "process_group", "weights", "versions", "admission", "adapters", "chat_template"}),
    ("engine", {"engine"}),
    ("tools", {"tools"}),
    ("rollout", {"rollout"}),
    ("cartridges", {"cartridges"}),
    ("inf", {"inf", "calls", "weight_sync"}),
    ("distill", {"distill"}),  # training cartridges is an application of InferenceEngine (synth, train, distill, eval)
    # pool/: the Ray replica pool (ReplicaPool, its Replica actor, its chunking), a composition of InferenceEngines
    ("apps", {"cli", "chat", "server", "evals", "bench", "client", "pool", "__main__", "verl_replica", "verl_cpu"}),
]
LEVEL = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def _modules() -> list[tuple[Path, str]]:
    """(file, the name its layer is looked up by). A feature's command line (`cli.py`, e.g. `final cartridge`
    in final/distill/cli.py) lives with its feature but is an app: it builds on InferenceEngine."""
    return [(p, "cli" if p.name == "cli.py" else p.relative_to(ROOT).parts[0].removesuffix(".py"))
            for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] != "__init__.py"]


def _imported_tops(tree: ast.AST) -> set[str]:
    """The first name under `final.` of every import of this package (inside functions too)."""
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "final":
            parts = node.module.split(".")
            tops.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            tops.update(a.name.split(".")[1] for a in node.names if a.name.startswith("final."))
    return tops


def test_every_module_has_a_layer():
    assert {top for _, top in _modules()} <= set(LEVEL), "add new top-level modules to LAYERS"


def test_cartridges_library_never_reaches_up():
    """final/cartridges/ is the format and serving library inf.py uses: no file there (a command line included)
    imports final.inf, final.cli or the training apps."""
    bad = [f"{p.relative_to(ROOT.parent)} imports final.{t}" for p in sorted((ROOT / "cartridges").rglob("*.py"))
           for t in _imported_tops(ast.parse(p.read_text())) if LEVEL[t] > LEVEL["cartridges"]]
    assert not bad, bad


def test_imports_point_down():
    upward = []
    for path, top in _modules():
        for imported in _imported_tops(ast.parse(path.read_text())):
            if LEVEL[imported] > LEVEL[top]:
                upward.append(f"{path.relative_to(ROOT.parent)} ({LAYERS[LEVEL[top]][0]}) imports final.{imported} "
                              f"({LAYERS[LEVEL[imported]][0]})")
    assert not upward, "\n".join(upward)


def test_backends_are_reached_through_their_interface():
    """Above final/rollout/, nothing probes a backend with hasattr/getattr: it asks the Backend interface."""
    probe = re.compile(r"\b(hasattr|getattr)\(\s*[\w.]*(rollout|backend)\b")
    found = [f"{p.relative_to(ROOT.parent)}:{i}" for p, top in _modules() if LEVEL[top] > LEVEL["rollout"]
             for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert not found, found


@pytest.mark.parametrize("path", [p for p, _ in _modules()], ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_stay_short(path):
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


@pytest.mark.parametrize("path", [p for p, _ in _modules()], ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_small(path):
    """~400 lines a file: past that a module holds more than one idea (split it, as inf.py lent calls.py)."""
    assert len(path.read_text().splitlines()) <= 420
