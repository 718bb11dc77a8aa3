"""Every third-party module final imports is declared in pyproject.toml: what a module imports when it is imported
(module level, following final's own imports) in the core requirements, or - for the packages an extra serves
(final/server/: `serve`, final/rollout/sglang/: `sglang`) - in that extra; what a function imports (an optional backend, a source, a peer) in the
core requirements or some extra. Nothing may arrive only because veRL happens to pull it today.

Import names are mapped to distributions with importlib.metadata.packages_distributions() (yaml -> PyYAML), and for
packages not installed here with NOT_INSTALLED below."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from functools import cache
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "final"
# packages whose module-level imports an extra provides (a user installs the extra to use them)
EXTRA_AREAS = {"server": "serve", "rollout/sglang": "sglang"}
# import name -> distribution, for optional packages this environment may not have installed
NOT_INSTALLED = {"flash_attn": "flash-attn", "llama_cpp": "llama-cpp-python", "lm_eval": "lm-eval", "wandb": "wandb",
                 "boto3": "boto3", "botocore": "botocore", "sglang": "sglang", "zmq": "pyzmq"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def declared() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """(core distributions, extra -> its distributions), normalized."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> frozenset[str]:
        return frozenset(normalize(Requirement(r).name) for r in reqs)

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


@cache
def distributions(module: str) -> frozenset[str]:
    found = importlib.metadata.packages_distributions().get(module) or [NOT_INSTALLED.get(module, module)]
    return frozenset(normalize(d) for d in found)


def third_party(name: str) -> bool:
    return name not in sys.stdlib_module_names and name not in ("final", "__future__")


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """The statements run when the module is imported (not inside functions or classes' methods, nor under
    `if TYPE_CHECKING:`)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [n for field in ("body", "orelse", "finalbody") for n in getattr(node, field, [])]
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
        elif isinstance(node, ast.ClassDef):
            todo += [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        else:
            out.append(node)
    return out


def _names(node: ast.AST) -> list[str]:
    """Dotted names an import statement imports (for `from a import b`: a.b too, b may be a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def _imports(path: Path, module_level: bool) -> tuple[frozenset[str], frozenset[Path]]:
    """(third-party top-level modules, final's own files) that `path` imports (at module level, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = _module_level(tree) if module_level else list(ast.walk(tree))
    names = [n for node in nodes for n in _names(node)]
    third = frozenset(n.split(".")[0] for n in names if third_party(n.split(".")[0]))
    own = set()
    for n in names:
        if n.split(".")[0] == "final":
            parts = n.split(".")
            own |= {f for i in range(1, len(parts) + 1) if (f := _file(".".join(parts[:i])))}  # parents run too
    return third, frozenset(own)


def reached_at_import(path: Path) -> dict[str, Path]:
    """Third-party module -> a file of final that imports it, over everything importing `path` runs."""
    seen, todo, found = set(), [path], {}
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        third, own = _imports(f, module_level=True)
        for m in third:
            found.setdefault(m, f)
        todo += own
    return found


def _area(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE).as_posix()
    return next((extra for folder, extra in EXTRA_AREAS.items() if rel.startswith(folder + "/")), None)


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_what_importing_a_module_needs_is_declared_where_its_users_get_it():
    core, extras = declared()
    missing: dict[tuple[str, str | None], str] = {}  # (module, extra) -> the first file that needs it
    for path in _files():
        extra = _area(path)
        allowed = core | (extras[extra] if extra else frozenset())
        for module, where in sorted(reached_at_import(path).items()):
            if not distributions(module) & allowed:
                missing.setdefault((module, extra), f"{path.relative_to(ROOT)} (through {where.relative_to(ROOT)})")
    assert not missing, "\n".join(
        f"{module} ({', '.join(sorted(distributions(module)))}) is needed at import by {first}: declare it in "
        f"{'the ' + extra + ' extra or ' if extra else ''}the core dependencies"
        for (module, extra), first in sorted(missing.items(), key=str))


def test_what_a_function_imports_is_declared_somewhere():
    core, extras = declared()
    anywhere = core.union(*extras.values())
    missing = sorted({f"{module} ({sorted(distributions(module))}) in {path.relative_to(ROOT)}"
                      for path in _files() for module in _imports(path, module_level=False)[0]
                      if not distributions(module) & anywhere})
    assert not missing, "undeclared: " + "; ".join(missing)


def test_the_walk_sees_what_it_should():
    """The test's own reading: pydantic reaches final.config through final.protocol.bodies; a function's import
    (llama_cpp in the bench peer) is not module level; yaml maps to PyYAML."""
    assert reached_at_import(PACKAGE / "config.py")["pydantic"] == PACKAGE / "protocol" / "bodies.py"
    assert "llama_cpp" not in reached_at_import(PACKAGE / "bench" / "peer.py")
    assert "llama_cpp" in _imports(PACKAGE / "bench" / "peer.py", module_level=False)[0]
    assert "fastapi" in reached_at_import(PACKAGE / "server" / "app.py") and _area(PACKAGE / "server" / "app.py")
    assert distributions("yaml") == {"pyyaml"} and distributions("hydra") == {"hydra-core"}
