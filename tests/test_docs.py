"""The documentation: the site builds with warnings as errors (a broken link, a missing page, an API reference that
does not resolve fails), its generated reference pages hold what the code holds, and the commands and code that
README.md and docs/getting-started.md tell a new user to copy work as written: the Python examples, the CLI and the
`final serve` example run for real; what the install commands name (scripts, extras, paths) exists."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from final.process_group import free_port

ROOT = Path(__file__).resolve().parents[1]
USER_PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# what `.venv/bin/X` of a command stands for in this test's interpreter (the venv the suite runs in)
VENV_TOOLS = {".venv/bin/final": [sys.executable, "-m", "final"], ".venv/bin/python": [sys.executable],
              ".venv/bin/mkdocs": [sys.executable, "-m", "mkdocs"]}


def blocks(page: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(page.read_text()) if kind == lang]


def commands(page: Path) -> list[list[str]]:
    """Every simple command of the page's bash blocks: continuation lines joined, comments dropped, `&&` chains
    split, a trailing `&` removed."""
    found = []
    for body in blocks(page, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                found.append([w for w in words[:cut] if w != "&"])
                words = words[cut + 1:]
    return [c for c in found if c]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_site_builds_strict_and_covers_the_pages(site):
    for page in ["index", "getting-started", "concepts/rollout-contract", "concepts/backends-and-lanes",
                 "concepts/cartridges", "concepts/tools", "guides/serve", "guides/serve-cartridge",
                 "guides/train-cartridge", "guides/train-tool-use-cartridge", "guides/evaluate",
                 "guides/verl-replica", "guides/train-a-policy", "guides/gpu-sglang", "guides/ray",
                 "guides/cpu-decode", "reference/api", "reference/cli", "reference/config", "reference/limits",
                 "reference/http", "benchmarks", "architecture"]:
        assert (site / page / "index.html").is_file() or (site / f"{page}.html").is_file() or \
            (page == "index" and (site / "index.html").is_file()), page


def test_generated_reference_pages_follow_the_code(site):
    from final.cli import build_parser
    from final.sampling import Limits
    from final.server.app import ROUTES

    cli = (site / "reference" / "cli" / "index.html").read_text()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, parser in sub.choices.items():
        assert f"final {name}" in cli, name
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in cli, (name, flag)
    config = (site / "reference" / "config" / "index.html").read_text()
    for key in Limits.__dataclass_fields__:
        assert key in config, key
    http = (site / "reference" / "http" / "index.html").read_text()
    for route in [*ROUTES, "/ping", "/v1/models", "/custom/cartridges", "/update_weights_from_disk"]:
        assert route in http, route
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ["InferenceEngine", "generate", "score", "update_weights", "GenerationOutput", "ReplicaPool",
                 "ConfigError", "evaluate_verl"]:
        assert name in api, name
    assert "only composition root" in api  # a docstring, rendered
    results = (site / "benchmarks" / "index.html").read_text()
    assert "P4: <code>generate</code> overhead" in results  # bench/RESULTS.md's dashboard, copied in


def test_install_commands_name_what_exists():
    """The two commands and the lanes' install lines: the scripts, venv tools, extras and test list they name."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "docs" in extras and "docs" in (ROOT / "scripts" / "install.sh").read_text()
    seen = set()
    for page in USER_PAGES:
        for cmd in commands(page):
            while cmd and re.fullmatch(r"[A-Z_]+=\S*", cmd[0]):  # FINAL_LANE=verl09 ...
                cmd = cmd[1:]
            head = cmd[0]
            seen.add(head)
            if head == "bash":
                assert (ROOT / cmd[1]).is_file(), cmd
            elif head == "pip":
                extra = re.search(r"\[(\w+)\]", cmd[-1]).group(1)
                assert extra in extras, cmd
            elif head in VENV_TOOLS or head in ("final", "curl"):
                continue  # run for real below
            else:
                pytest.fail(f"{page.name}: a command this test does not know how to check: {cmd}")
    assert {"bash", ".venv/bin/final", ".venv/bin/python"} <= seen


def _final_argv(cmd: list[str]) -> list[str] | None:
    return cmd[1:] if cmd[0] in (".venv/bin/final", "final") else None


def test_cli_commands_parse_and_the_main_job_runs():
    """Every `final ...` line parses with the real parser; the README's main job and `final --help` run."""
    from final.cli import build_parser

    lines = [argv for page in USER_PAGES for cmd in commands(page) if (argv := _final_argv(cmd)) is not None]
    # and the reproduce commands of bench/RESULTS.md's dashboard that are `final ...` commands
    dashboard = (ROOT / "bench" / "RESULTS.md").read_text().split("<!-- dashboard: end -->")[0]
    lines += [shlex.split(c)[1:] for c in re.findall(r"\| `(final [^`]+)` \|", dashboard)]
    assert len(lines) > 10
    for argv in lines:
        if argv in (["--help"], ["-h"]):
            continue
        build_parser().parse_args(argv)  # SystemExit (exit 2) on an unknown flag or subcommand
    helped = subprocess.run([sys.executable, "-m", "final", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert helped.returncode == 0 and "generate" in helped.stdout and "serve" in helped.stdout
    main_job = commands(ROOT / "README.md")[1]
    assert main_job[0] == ".venv/bin/final" and main_job[1] == "generate", main_job
    done = subprocess.run(VENV_TOOLS[main_job[0]] + main_job[1:], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_python_examples_run_as_written(page):
    examples = blocks(page, "python")
    assert examples, page
    for code in examples:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip(), code


def _wait_for_ping(url: str, server: subprocess.Popen) -> None:
    for _ in range(600):
        assert server.poll() is None, server.stderr.read()
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2) as r:
                if json.loads(r.read()) == {"message": "pong"}:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail("final serve did not answer /ping")


@pytest.mark.slow
@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_serve_example_runs(page):
    """The page's `final serve` line and its curl lines, run as written (on a free port instead of 10210, which
    another process on this machine may hold)."""
    cmds = commands(page)
    serve = next(c for c in cmds if _final_argv(c) and _final_argv(c)[0] == "serve")
    port = str(free_port())
    argv = [port if w == "10210" else w for w in VENV_TOOLS[serve[0]] + serve[1:]]
    curls = [[w.replace(":10210", f":{port}") for w in c] for c in cmds if c[0] == "curl"]
    assert curls
    server = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_ping(f"http://127.0.0.1:{port}", server)
        for curl in curls:
            done = subprocess.run(curl, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            answer = json.loads(done.stdout)
            assert answer == {"message": "pong"} or answer["choices"], answer
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_dashboard_plots_are_drawn_from_the_recorded_figures(tmp_path):
    """bench/plots.py finds its tables in bench/RESULTS.md (by their headers) and writes the three PNGs the
    dashboard and the Benchmarks page show; a table that moved out of RESULTS.md fails here, not on a reader."""
    done = subprocess.run([sys.executable, "bench/plots.py", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ["decode_vs_batch.png", "cartridge_kl.png", "tool_call_rate.png"]:
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert (ROOT / "docs" / "img" / name).is_file(), name  # the committed copy the pages link to
