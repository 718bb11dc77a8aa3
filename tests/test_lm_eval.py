"""lm-eval itself against `final serve`: its `local-completions` model runs a multiple-choice task and a perplexity
(loglikelihood_rolling) task, both defined from JSONL files shipped in tests/lm_eval_tasks (no hub access), and
picks the same choice as lm-eval's own `hf` model on the same weights, question for question.

Both are lm-eval's command line, as README shows it. `add_bos_token=True` makes local-completions tokenize as the
hf model does for this tokenizer (which adds a BOS); without it the two models send different tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_helpers import spawn_serve, stop_serve

ROOT = Path(__file__).resolve().parents[1]
TASKS = "final_mc,final_rolling"
MAX_LENGTH = 256  # lm-eval's window; at most the server's rollout.prompt_length


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`final serve` of the tiny model on a free 127.0.0.1 port (read from uvicorn's startup line)."""
    cfg = tmp_path_factory.mktemp("serve") / "config.yaml"
    cfg.write_text("model_path: builtin:tiny-random-llama\nprogress: false\n"
                   f"rollout: {{name: local, prompt_length: {MAX_LENGTH}, response_length: 16}}\n")
    url, proc = spawn_serve("--config", str(cfg))
    yield url
    stop_serve(proc)


def lm_eval(model: str, model_args: str, out: Path, *extra: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASKS,
           "--include_path", "tests/lm_eval_tasks", "--log_samples", "--output_path", str(out), *extra]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


def samples(out: Path, task: str) -> list[dict]:
    [path] = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_local_completions_picks_what_its_hf_model_picks(server, tmp_path, tiny_dir):
    lm_eval("local-completions", f"model=tiny,base_url={server}/v1/completions,tokenizer={tiny_dir},"
            f"tokenizer_backend=huggingface,max_length={MAX_LENGTH},add_bos_token=True,max_retries=1",
            tmp_path / "served")
    lm_eval("hf", f"pretrained={tiny_dir},dtype=float32,max_length={MAX_LENGTH}", tmp_path / "hf", "--device", "cpu")

    served, hf = samples(tmp_path / "served", "final_mc"), samples(tmp_path / "hf", "final_mc")
    assert [s["doc_id"] for s in served] == [s["doc_id"] for s in hf] == list(range(8))
    for a, b in zip(served, hf):
        ours = [(float(ll), greedy) for ll, greedy in a["filtered_resps"]]
        theirs = [(float(ll), greedy) for ll, greedy in b["filtered_resps"]]
        pick = max(range(len(ours)), key=lambda i: ours[i][0])
        assert pick == max(range(len(theirs)), key=lambda i: theirs[i][0]), (a["doc"], ours, theirs)
        assert [g for _, g in ours] == [g for _, g in theirs]  # is_greedy, from our top_logprobs
        assert max(abs(x - y) for (x, _), (y, _) in zip(ours, theirs)) < 1e-3
        assert a["acc"] == b["acc"]

    served, hf = samples(tmp_path / "served", "final_rolling"), samples(tmp_path / "hf", "final_rolling")
    assert len(served) == len(hf) == 3
    for a, b in zip(served, hf):
        assert float(a["filtered_resps"][0]) == pytest.approx(float(b["filtered_resps"][0]), abs=1e-3)
