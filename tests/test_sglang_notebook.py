"""Notebooks on a real Jupyter kernel (nbclient + ipykernel): a cell runs inside the kernel's event loop, where
veRL's run_until_complete would fail and SGLang would be bound to the wrong loop without the rollout thread."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from sglang_helpers import CPU_ARGS, pythonpath

REPO = Path(__file__).resolve().parents[1]


def execute(nb, cwd: Path, env_path: str | None = None):
    env_path = env_path or os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path  # the kernel process inherits it
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return ["".join(o.get("text", "") for o in cell.get("outputs", [])
                    if o.get("output_type") == "stream" and o.get("name") == "stdout")
            for cell in nb.cells if cell.cell_type == "code"]


@pytest.mark.slow
def test_quickstart_notebook_runs_generate_agenerate_a_cartridge_grpo_and_tools():
    nb = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    out = execute(nb, REPO / "examples")
    assert "backend: local" in out[0]  # CPU: the embedded engine (SGLang on a CUDA machine)
    assert "Paris" in out[1]
    # awaited in the kernel's running loop, concurrently: the same greedy answers as the blocking calls
    assert out[3].splitlines() == [out[1].splitlines()[0], ast.literal_eval(out[2].splitlines()[0])]
    cart, in_prompt = [line.split(": ", 1)[1] for line in out[4].splitlines()[:2]]
    assert cart == in_prompt  # the cartridge answers as the document in the prompt does
    # GRPO on the tiny model: each step's rows come from the version the last update made
    assert out[5].splitlines() == [f"step {i}: rows from version {i}, now serving {i + 1}" for i in range(3)]
    # tool calling: the few-shot rows' calls parsed (London's is right at greedy), then the call run with max_turns
    lines = out[6].splitlines()
    assert lines[0] == "London -> [('get_weather', {'city': 'London'})]" and lines[-1].startswith("right calls: ")
    assert out[7].splitlines()[0].startswith("['assistant', 'tool_call', 'tool_result', 'assistant'")
    assert out[7].splitlines()[1] == "sunny in London"


def test_sglang_rollout_from_notebook_cells(tmp_path):
    """The SGLang backend (veRL's SGLangRollout on the real SGLang 0.5.2 engine on CPU, its scheduler spawned from
    the kernel process, which gets the kernel stubs through PYTHONPATH)."""
    env_path = pythonpath(str(REPO))
    cfg = {"model_path": "builtin:tiny-random-llama", "progress": False,
           "rollout": {"name": "sglang", "prompt_length": 32, "response_length": 8, "dtype": "float32",
                       "engine_kwargs": {"sglang": CPU_ARGS}}}
    nb = new_notebook(cells=[
        new_code_cell(f"from final.inf import InferenceEngine\n"
                      f"engine = InferenceEngine({cfg!r})\nprint(engine.backend)"),
        new_code_cell("a = engine.generate([[1, 17, 99], [1, 504]], temperature=0)\nprint(a.token_ids)"),
        new_code_cell("b = await engine.agenerate([[1, 17, 99], [1, 504]], temperature=0)\n"
                      "print(b.token_ids == a.token_ids)"),
        new_code_cell("import asyncio\n"
                      "c = await asyncio.gather(*[engine.agenerate([1, 17, 99], temperature=0) for _ in range(3)])\n"
                      "print(all(x.token_ids[0] == a.token_ids[0] for x in c))"),
        new_code_cell("engine.shutdown()\nprint('closed')"),
    ], metadata={"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}})
    out = execute(nb, tmp_path, env_path)
    assert out[0].strip() == "sglang" and out[1].startswith("[[") and out[2].strip() == "True"
    assert out[3].strip() == "True" and out[4].strip() == "closed"
