"""Issue 28: tool-use traces (`final cartridge traces`) follow the multi-turn path's own tokens, and a cartridge
trained on them (`final cartridge train`, hard targets through the distillation code) makes a model that never
calls a tool decide to call it: the real multi-turn path parses its call, runs the real tool, and the model answers
after the tool's response (embedded engine here; SGLang 0.5.2 in tests/test_sglang_inference.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from final.config import load_config
from final.training.rows import read_conversations
from final.training.traces import TraceBuilder, build_traces, reference_turns, student_turns, trace_rows
from final.errors import ConfigError
from final.models import resolve_model_path
from final.tools.gsm8k_task import load_problems
from multiturn_helpers import TOOL_PROBLEMS, make_tool_model, tool_config, train_tool_cartridge, write_gsm8k

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools.yaml"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    import verl.workers.rollout.schemas as schemas

    logging.getLogger(schemas.__file__).setLevel(logging.ERROR)
    return make_tool_model(resolve_model_path("builtin:tiny-random-llama"), tmp_path_factory.mktemp("tm") / "m")


def test_reference_turns_are_the_solution_a_call_and_the_answer(tmp_path):
    [problem] = load_problems(write_gsm8k(tmp_path / "g.jsonl"))
    first, last = reference_turns(problem)
    assert first.startswith("3 + 4 = 7 pens.\n<tool_call>\n") and "<<" not in first
    call = json.loads(first.split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    assert call == {"name": "calc_gsm8k_reward", "arguments": {"answer": "7"}}
    assert last == "#### 7"


def test_trace_rows_merge_a_continued_stream_and_split_a_rerendered_one():
    rows = trace_rows([([1, 2], [3, 4]), ([1, 2, 3, 4, 5, 6], [7, 8])])
    assert [(r.prompt_ids, r.answer_ids, r.mask) for r in rows] == [([1, 2], [3, 4, 5, 6, 7, 8], [1, 1, 0, 0, 1, 1])]
    rows = trace_rows([([1, 2], [3, 4]), ([1, 2, 9, 5], [7])])  # turn 1 re-rendered: a row of its own
    assert [(r.prompt_ids, r.answer_ids, r.mask) for r in rows] == [([1, 2], [3, 4], [1, 1]), ([1, 2, 9, 5], [7], [1])]


def test_student_turns_keep_its_reasoning_up_to_the_solution_length_and_call_with_its_last_number(tmp_path):
    problem = load_problems(write_gsm8k(tmp_path / "g.jsonl", [("Q?", "a = <<1+1=2>>2\nb = 2 * 3 = 6\n#### 6")]))[0]
    loop = "He has 2 pens.\nHe has 2,400 pens.\nHe has 2 pens.\nHe has 2 pe"  # a greedy loop cut by the limit
    assert student_turns(problem, loop, finished=False) == [
        ("He has 2 pens.\nHe has 2,400 pens.\n", '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": '
                                                   '{"answer": "2400"}}\n</tool_call>'), ("", "#### 2400")]
    called = student_turns(problem, "x = 5\n<tool_call>\n{bad json", finished=True)
    assert called[0][0] == "x = 5\n" and '"answer": "5"' in called[0][1]
    answered = student_turns(problem, "no numbers here\n#### 9", finished=True)  # answered instead of calling
    assert answered[0][0] == "no numbers here\n" and answered[1] == ("", "#### 6")  # none reasoned: the truth
    assert student_turns(problem, "cut mid-li", finished=False)[0][0] == ""


def test_student_rows_read_its_own_reasoning_and_learn_the_call_and_the_answer_the_verdict_asks_for(tool_model,
                                                                                                    tmp_path):
    """Played through the real rollout: the student's reasoning is in the row with mask 0; the call (run by the
    real tool) and the closing answer are the targets. The tool rejected the student's 8 (reward=0.0, which the row
    shows the model), so the closing answer is the problem's 7, not the rejected 8 again."""
    from transformers import AutoTokenizer

    [problem] = load_problems(write_gsm8k(tmp_path / "g.jsonl"))
    tok = AutoTokenizer.from_pretrained(tool_model)
    builder = TraceBuilder(load_config(tool_config(tool_model, TOOLS)), tok, tok.eos_token_id)
    [row], [call] = builder.play_student(problem, "Ann has 3 + 4 = 8 pens.\nAnn", finished=False)
    assert call["arguments"] == {"answer": "8"} and call["response"] == "Current parsed answer='8' reward=0.0"
    context = tok.decode([t for t, m in zip(row.answer_ids, row.mask) if not m])
    targets = tok.decode([t for t, m in zip(row.answer_ids, row.mask) if m])
    assert context.startswith("Ann has 3 + 4 = 8 pens.") and "reward=0.0" in context
    assert targets.lstrip().startswith("<tool_call>") and targets.endswith("#### 7<|im_end|>")
    assert "pens" not in targets and "#### 8" not in targets
    [row], [call] = builder.play_student(problem, "Ann has 3 + 4 = 7 pens.\nAnn", finished=False)  # accepted
    assert call["response"] == "Current parsed answer='7' reward=1.0"
    assert tok.decode([t for t, m in zip(row.answer_ids, row.mask) if m]).endswith("#### 7<|im_end|>")


def test_traces_from_a_student_cartridge_end_to_end(tool_model, tmp_path):
    """`traces --student`: the model behind a cartridge writes each first turn (InferenceEngine), and its rows
    get ids of their own, so the file can be concatenated with the reference rows."""
    from final.cartridges.build import build_from_text, document_ids
    from final.cartridges.format import save_cartridge
    from final.inf import InferenceEngine

    data = write_gsm8k(tmp_path / "g.jsonl")
    with InferenceEngine({"model_path": tool_model, "progress": False}) as engine:  # as the CLI opens it
        save_cartridge(build_from_text(engine.engine, document_ids(engine.tokenizer, "Count the pens.")),
                       tmp_path / "s.pt")
        summary = build_traces(load_config(tool_config(tool_model, TOOLS)), data, tmp_path / "t.jsonl",
                               progress=False, student=(engine, str(tmp_path / "s.pt")), student_tokens=16)
        assert engine.cartridges.ids() == []  # the student's cartridge is unloaded again
    [row] = read_conversations(tmp_path / "t.jsonl", 10**6)
    assert summary["rows"] == 1 and row.id == 50 and row.mask[-1] == 1


def test_traces_on_a_template_that_renders_calls_are_one_masked_row(tool_model, tmp_path):
    from transformers import AutoTokenizer

    data = write_gsm8k(tmp_path / "g.jsonl")
    out = tmp_path / "t.jsonl"
    summary = build_traces(load_config(tool_config(tool_model, TOOLS)), data, out, progress=False)
    assert summary["problems"] == 1 and summary["rows"] == 1
    tok = AutoTokenizer.from_pretrained(tool_model)
    [row] = read_conversations(out, len(tok))
    assert row.first_target == len(row.prompt_ids) and row.top_logprobs[0] == [0.0]  # hard targets
    targets = [t for t, m in zip(row.answer_ids, row.mask) if m]
    masked = tok.decode([t for t, m in zip(row.answer_ids, row.mask) if not m])
    assert "<tool_response>" in masked and "reward=1.0" in masked  # the real tool's response, not a target
    assert '"arguments": {"answer": "7"}' in tok.decode(targets) and tok.decode(targets).endswith("#### 7<|im_end|>")
    # the rollout's own prompt ids (this tokenizer's BOS is <|im_start|>, so the stream opens with it twice)
    assert tok.decode(row.prompt_ids).endswith("`####`.<|im_end|>\n<|im_start|>assistant\n")


def test_traces_on_smollm2_split_where_veRL_rerenders_the_call(tmp_path):
    """SmolLM2's template drops tool_calls: veRL re-renders the calling turn without its call, so the answer turn
    reads another stream, and is a row of its own (what the model reads there, not what it wrote)."""
    from transformers import AutoTokenizer

    model = "builtin:smollm2-135m-instruct"
    data = write_gsm8k(tmp_path / "g.jsonl")
    summary = build_traces(load_config(tool_config(model, TOOLS)), data, tmp_path / "t.jsonl", progress=False)
    assert summary["rows"] == 2
    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    first, second = read_conversations(tmp_path / "t.jsonl", len(tok))
    assert "<tool_call>" in tok.decode(first.answer_ids) and first.mask is None
    read = tok.decode(second.prompt_ids)
    assert '{"answer": "7"}' not in read and read.endswith("7 pens.<|im_end|>\n<|im_start|>tool\nCurrent parsed "
                                                          "answer='7' reward=1.0<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(second.answer_ids) == "#### 7<|im_end|>"


def test_traces_refuse_bad_input_by_name(tool_model, tmp_path):
    data = write_gsm8k(tmp_path / "g.jsonl")
    cfg = load_config(tool_config(tool_model, TOOLS))
    (tmp_path / "old.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="--out"):
        build_traces(cfg, data, tmp_path / "old.jsonl")
    with pytest.raises(ConfigError, match="--skip"):
        build_traces(cfg, data, tmp_path / "t.jsonl", skip=5)
    no_tool = tmp_path / "tools.yaml"
    no_tool.write_text(TOOLS.read_text().replace("name: calc_gsm8k_reward", "name: other_tool"))
    with pytest.raises(ConfigError, match="--tools"):
        build_traces(load_config(tool_config(tool_model, no_tool)), data, tmp_path / "t.jsonl")
    assert not (tmp_path / "t.jsonl").exists()


def test_a_trained_tool_cartridge_makes_the_model_call_the_tool(tool_model, tmp_path, capsys):
    """The random model never calls; behind the trained cartridge it writes a call the parser accepts, the tool
    runs, its response is in the conversation with mask 0, and the model answers after it. `final eval gsm8k
    --cartridge` drives the same path."""
    from final import cli
    from final.inf import InferenceEngine
    from final.tools.gsm8k_task import build_messages

    cartridge, data = train_tool_cartridge(tool_model, TOOLS, tmp_path)
    [problem] = load_problems(data)
    kwargs = [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "7"}}}]
    with InferenceEngine(tool_config(tool_model, TOOLS)) as engine:
        messages = [build_messages(problem, engine.tool_schemas(), True)]
        plain = engine.generate(messages, tools_kwargs=kwargs, temperature=0)
        assert plain.metadata[0]["tool_calls"] == []
        engine.load_cartridge(path=str(cartridge))
        out = engine.generate(messages, tools_kwargs=kwargs, temperature=0, cartridge=str(cartridge))
    meta = out.metadata[0]
    [call] = meta["tool_calls"]
    assert (call["name"], call["arguments"], call["error"]) == ("calc_gsm8k_reward", {"answer": "7"}, None)
    assert call["response"] == "Current parsed answer='7' reward=1.0" and meta["num_turns"] >= 2
    tool_part = engine.tokenizer.decode([t for t, m in zip(meta["response_ids"], meta["response_mask"]) if not m])
    assert "Current parsed answer='7' reward=1.0" in tool_part
    assert out.completions[0] == "#### 7"

    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(tool_config(tool_model, TOOLS)))
    results = tmp_path / "r.jsonl"
    assert cli.main(["eval", "gsm8k", "--config", str(config), "--data", str(data), "--tools", str(TOOLS),
                     "--cartridge", str(cartridge), "--out", str(results)]) == 0
    printed = capsys.readouterr().out
    assert "tool-call rate                 1.000" in printed and "accuracy (veRL gsm8k, strict)  1.000" in printed
    assert len(TOOL_PROBLEMS) == len(results.read_text().splitlines())


def test_a_shared_prompt_runs_once_and_gives_the_same_loss_and_gradient(tool_model, tmp_path, monkeypatch):
    """Student.log_probs runs the rows' common leading tokens (the tool system prompt) once for the batch: the
    log-probs and the cartridge's gradient equal those of every row run whole."""
    import torch

    import final.training.student as students
    from final.training.rows import Conversation
    from final.training.train import make_batch

    build_traces(load_config(tool_config(tool_model, TOOLS)), write_gsm8k(tmp_path / "g.jsonl"),
                 tmp_path / "t.jsonl", progress=False)
    student = students.Student(tool_model)
    [row] = read_conversations(tmp_path / "t.jsonl", student.vocab_size)
    short = Conversation(1, row.prompt_ids, row.answer_ids[:-3], row.top_ids[:-3], row.top_logprobs[:-3],
                         target_start=row.target_start, mask=row.mask[:-3])
    batch = make_batch([row, short], 0, student.device)
    assert students._shared_prefix(batch.ids, batch.where) == len(row.prompt_ids) - 1
    cache = students.TrainableKV(*student.prefill(row.ids[:8]), 1)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in cache.trainable_keys:
            p.grad = None
        logq = student.log_probs(*cache.full(), batch.ids, batch.where)
        logq.gather(1, batch.targets.top_ids[:, :1]).sum().backward()  # the hard targets: top-1
        return logq.detach(), [p.grad.clone() for p in cache.trainable_keys]

    shared, grads = run()
    monkeypatch.setattr(students, "_shared_prefix", lambda ids, where: 0)  # every row run whole
    whole, whole_grads = run()
    assert torch.allclose(shared, whole, atol=1e-4)
    for g, w in zip(grads, whole_grads):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
