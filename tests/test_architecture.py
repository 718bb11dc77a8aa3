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
    ("training", {"training"}),  # training cartridges is an application of InferenceEngine (learn, traces, eval)
    # pool/: the Ray replica pool (ReplicaPool, its Replica actor, its chunking), a composition of InferenceEngines
    ("apps", {"cli", "cartridge_commands", "cartridge_files", "chat", "server", "evals", "bench", "client", "pool",
              "__main__", "verl_replica", "verl_cpu"}),
]
LEVEL = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
# The only modules of final a function may import (everything else is imported at the top of its module, where the
# structure shows): each pulls in, at its top or through the final modules it imports there, a heavy dependency that
# many commands never need - the name the value lists - so it is imported by the call that needs it (`final --help`,
# `final cartridge inspect` load no veRL). test_lazy_imports_are_only_of_heavy_optional_modules checks each still does.
LAZY = {
    "final.inf": "verl",  # veRL (DataProto) and Ray: seconds to import, for any command that runs no model
    "final.tools.outputs": "verl",  # the tool-call events of a streamed chat: veRL's tool schemas
    "final.server.app": "fastapi",  # the `serve` extra
    "final.server.limits": "uvicorn",  # the `serve` extra
    "final.verl_replica": "verl.single_controller",  # veRL's Ray replica machinery (the trainer's, not ours)
    "final.training.onpolicy.verl_rollout": "verl.experimental",  # veRL's agent loop: Ray actors and hydra
    "final.rollout.sglang.engine_052": "sglang",  # the `sglang` extra (CUDA)
    "final.rollout.sglang.grammar_backend": "sglang",  # SGLang 0.5.12's grammar classes, in its scheduler child
}
# Modules that may import final's modules inside functions whatever they are, and why.
LAZY_IMPORTERS = {
    # veRL's plug-in hook imports it while `import verl` runs: a module that imports verl at its top (final.prompts,
    # final.rollout.*) would find verl half-initialised, so they load on first use
    "final.verl_replica",
}


def _modules() -> list[tuple[Path, str]]:
    """(file, the name its layer is looked up by). A feature's command line (`cli.py`, e.g. `final cartridge`
    in final/cartridge_commands.py) lives with its feature but is an app: it builds on InferenceEngine."""
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


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, in_functions: bool) -> list[tuple[ast.AST, str]]:
    """(node, imported module) of every import of final's own modules at the module's top (in_functions=False; an
    `if TYPE_CHECKING:` block is no import) or inside a function (True); `from final.x import y` names final.x.y
    too where y is a module."""
    out = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue
            now = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("final"):
                if now == in_functions:
                    out.append((child, child.module))
                    out.extend((child, f"{child.module}.{a.name}") for a in child.names)
            elif isinstance(child, ast.Import) and now == in_functions:
                out.extend((child, a.name) for a in child.names if a.name.split(".")[0] == "final")
            visit(child, now)

    visit(tree, False)
    return out


def test_no_import_circle_in_final():
    """Every import of final's modules (at the top or in a function), and the packages each one runs: no two
    modules reach each other (a circle leaves one of them half-initialised, depending on which is imported first)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        edges = set()
        for _, target in _imports(tree, False) + _imports(tree, True):
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[name] = {t for t in edges if t in modules and t != name and not name.startswith(t + ".")}
    circles = _strongly_connected(graph)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_lazy_imports_are_only_of_heavy_optional_modules():
    """A module of final imports final's modules at its top; only LAZY's may be imported inside a function."""
    lazy = [f"{p.relative_to(ROOT.parent)}:{node.lineno} imports {target}" for p in sorted(ROOT.rglob("*.py"))
            if _module(p) not in LAZY_IMPORTERS for node, target in _imports(ast.parse(p.read_text()), True)
            if isinstance(node, ast.Import) or target == node.module
            if not any(target == m or target.startswith(m + ".") for m in LAZY)]
    assert not lazy, "\n".join(lazy)
    for module, heavy in LAZY.items():
        assert any(n == heavy or n.startswith(heavy + ".") for n in _loads(module)), f"{module} no longer imports {heavy}"


def _loads(module: str, seen: set[str] | None = None) -> set[str]:
    """What importing `module` imports at module level: its own top-level imports and, through final's modules among
    them (and the packages they run), theirs."""
    seen = set() if seen is None else seen
    if module in seen:
        return set()
    seen.add(module)
    base = ROOT.parent / module.replace(".", "/")
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return set()
    names = set()
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    out = set(names)
    for name in names:
        if name.split(".")[0] == "final":
            parts = name.split(".")
            for i in range(2, len(parts) + 1):
                out |= _loads(".".join(parts[:i]), seen)
    return out


def _top_level(tree: ast.AST) -> list[ast.AST]:
    """The module's statements that run when it is imported (inside `with` or `try` blocks too), not functions'."""
    out, todo = [], list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        out.append(node)
        todo += list(ast.iter_child_nodes(node))
    return out


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
