"""Shared pieces for multi-turn tests: a tool-capable tiny model folder, a scripted engine, veRL configs, batches.

- `make_tool_model(dst)`: builtin:tiny-random-llama (random 2-layer Llama, SmolLM2 tokenizer) turned into a
  Qwen2.5-style tool model: two unused special tokens (<jupyter_start>, <jupyter_text>; ids 11, 12) become the
  ordinary added tokens <tool_call> and </tool_call> (non-special, so decode keeps them, as in Qwen's tokenizer,
  and SGLang's vocabulary detection picks qwen25), and the chat template is Qwen2.5's (tools in the system prompt,
  tool calls in assistant turns, tool results as <tool_response> blocks). Vocabulary size and weights unchanged.
- `ScriptedEngine`: speaks SGLang 0.5.2's async_generate dialect but answers from a script instead of a model: the
  reply for a conversation is chosen by a key found in the prompt and by how many assistant turns it already has,
  tokenized, cut at max_new_tokens (finish "length") or ended with EOS (finish "stop"). It lets tests drive the real
  state machine through exact conversations (a tool call, then an answer) with no randomness.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from verl import DataProto

from final.compat import chat_ids

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_RENAME = {11: "<tool_call>", 12: "</tool_call>"}


def make_tool_model(src: str, dst: Path) -> str:
    """Copy the model folder `src` to `dst` as a Qwen2.5-style tool model (see module doc)."""
    return renamed_model(src, dst, {i: (name, False) for i, name in _RENAME.items()}, QWEN25_TEMPLATE)


def renamed_model(src: str, dst: Path, rename: dict[int, tuple[str, bool]], template: str) -> str:
    """Copy the model folder `src` to `dst` with unused special tokens renamed (id -> (text, special)) and another
    chat template; vocabulary size and weights unchanged (the weights are linked)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.name.endswith(".safetensors"):
            os.symlink(f.resolve(), dst / f.name)
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    tok = json.loads((dst / "tokenizer.json").read_text())
    for entry in tok["added_tokens"]:
        if entry["id"] in rename:
            entry["content"], entry["special"] = rename[entry["id"]]
    vocab = tok["model"]["vocab"]
    for old in [k for k, i in vocab.items() if i in rename]:
        del vocab[old]
    for i, (name, _) in rename.items():
        vocab[name] = i
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    # transformers 4 also writes the added tokens here; 5 keeps them in tokenizer.json only (and a folder
    # converted on one lane is read on the other: FINAL_CACHE is shared).
    for i, (name, special) in rename.items():
        if str(i) in cfg.get("added_tokens_decoder", {}):
            cfg["added_tokens_decoder"][str(i)].update(content=name, special=special)
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "chat_template.jinja").write_text(template)
    return str(dst)


class ScriptedEngine:
    """An engine that answers from `script`: {key: [reply for assistant turn 0, turn 1, ...]}."""

    def __init__(self, tokenizer: Any, script: dict[str, list[str]], eos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.script = script
        self.eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.calls: list[dict] = []
        self.flushes = 0

    async def async_generate(self, prompt: Any = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, image_data: Any = None,
                             return_logprob: bool = False, logprob_start_len: int | None = None,
                             cartridges: Any = None) -> dict:
        await asyncio.sleep(0)  # let other requests interleave, as a real engine would
        text = self.tokenizer.decode(input_ids)
        self.calls.append({"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                           "cartridges": cartridges, "text": text})
        keys = [k for k in self.script if k in text]
        assert len(keys) == 1, f"prompt matches script keys {keys}: {text!r}"
        turn = text.count("<|im_start|>assistant") - 1
        replies = self.script[keys[0]]
        reply = replies[min(turn, len(replies) - 1)]
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos]
        limit = sampling_params["max_new_tokens"]
        finish = {"type": "stop", "matched": self.eos}
        if len(ids) > limit:
            ids, finish = ids[:limit], {"type": "length", "length": limit}
        meta = {"id": f"scripted-{len(self.calls)}", "finish_reason": finish, "prompt_tokens": len(input_ids),
                "completion_tokens": len(ids), "cached_tokens": 0}
        if return_logprob:
            meta["output_token_logprobs"] = [(-0.5, t, None) for t in ids]
        return {"output_ids": ids, "meta_info": meta}

    def flush_cache(self) -> bool:
        self.flushes += 1
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        return None


def generate_fn(rollout: Any, tokenizer: Any):
    """generate(messages, tools_kwargs) -> GenerationOutput over a MultiTurnRollout, as InferenceEngine.generate
    runs a multi-turn call (the rows' metadata with the tool trace; evals take this shape)."""
    from final.outputs import GenerationOutput
    from final.prompts import build_dataproto, normalize_prompts, tokenize
    from final.tools.outputs import conversation_rows

    def generate(messages: list, tools_kwargs: list[dict] | None) -> GenerationOutput:
        items = normalize_prompts(messages)
        data = build_dataproto(tokenize(items, tokenizer, 1024), items, tokenizer.pad_token_id,
                               [tokenizer.eos_token_id], meta_info={"do_sample": False, "final_tool_trace": True},
                               non_tensor={"tools_kwargs": tools_kwargs})
        rows = conversation_rows(rollout.generate_sequences(data), tokenizer)
        meta = [{**r.to_metadata(), "finish_reason": "stop"} for r in rows]
        return GenerationOutput([r.final_text for r in rows], [r.response_ids for r in rows], meta)

    return generate


def rollout_config(**overrides: Any):
    """veRL's RolloutConfig for the local multi-turn path (tp=1, real weights, token-in-token-out)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    multi_turn = {"enable": True, **overrides.pop("multi_turn", {})}
    conf = {"name": "local", "tensor_model_parallel_size": 1, "load_format": "auto", "skip_tokenizer_init": True,
            "prompt_length": 256, "response_length": 128, "multi_turn": multi_turn, **overrides}
    return omega_conf_to_dataclass(conf, dataclass_type=RolloutConfig)


def chat_batch(tokenizer: Any, conversations: list[list[dict]], tools_kwargs: list[dict] | None = None,
               prompt_length: int = 256, **meta: Any) -> DataProto:
    """A left-padded prompt batch with raw_prompt (and tools_kwargs), as veRL's RL dataset builds it."""
    rows = [chat_ids(tokenizer, c, add_generation_prompt=True) for c in conversations]
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), prompt_length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), prompt_length), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, prompt_length - len(ids):] = torch.tensor(ids)
        attention_mask[i, prompt_length - len(ids):] = 1
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    non_tensor = {"raw_prompt": _objects(conversations)}
    if tools_kwargs is not None:
        non_tensor["tools_kwargs"] = _objects(tools_kwargs)
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask,
                                        "position_ids": position_ids},
                               non_tensors=non_tensor,
                               meta_info={"eos_token_id": tokenizer.eos_token_id, "do_sample": False, **meta})


def _objects(items: list) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


# ---- a tool-use cartridge on the tool model (final cartridge traces + train) ------------------------------------
TOOL_PROBLEMS = [("Ann has 3 pens and buys 4 more. How many pens?", "3 + 4 = <<3+4=7>>7 pens.\n#### 7")]


def write_gsm8k(path: Path, problems: list[tuple[str, str]] = TOOL_PROBLEMS) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in problems))
    return path


def tool_config(model: str, tools: Path, **rollout: Any) -> dict:
    """An InferenceEngine config: the embedded engine on `model`, multi-turn with `tools`."""
    return {"model_path": model, "progress": False,
            "rollout": {"name": "local", "prompt_length": 512, "response_length": 128, "calculate_log_probs": False,
                        "multi_turn": {"enable": True, "tool_config_path": str(tools), "max_assistant_turns": 3,
                                       "tokenization_sanity_check_mode": "disable"}, **rollout}}


def train_tool_cartridge(model: str, tools: Path, tmp: Path) -> tuple[Path, Path]:
    """`final cartridge traces` + `train` on TOOL_PROBLEMS: a 64-token cartridge that makes the random tool model
    write the reference turns. 400 Adam steps at lr 0.1 bring the loss to ~0.1, and greedy decoding to every target (the random model needs a high rate).
    p=32 at lr 0.2 did on one EPYC and stalled at 0.6 on another: float differences move a run this close to its
    limit. One torch thread: on two cores the tiny model's ops are faster without OpenMP regions."""
    from final.config import load_config
    from final.training.traces import build_traces
    from final.training.settings import TrainConfig
    from final.training.train import train_cartridge

    data = write_gsm8k(tmp / "gsm8k.jsonl")
    build_traces(load_config(tool_config(model, tools)), data, tmp / "traces.jsonl", progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # at these rates the loss is not monotone: a run that ends on a bump goes on (it resumes) to 800 steps
        for steps in range(400, 801, 100):
            done = train_cartridge(model, tmp / "traces.jsonl", tmp / "tooluse.pt",
                                   TrainConfig(tokens=64, steps=steps, batch=1, lr=0.1), progress=False)
            if done["last_loss"] < 0.2:
                break
    finally:
        torch.set_num_threads(threads)
    return tmp / "tooluse.pt", data
