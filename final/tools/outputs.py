"""Per-row views of a multi-turn DataProto, for people rather than trainers.

veRL's multi-turn output keeps what training needs: token tensors, response_mask, the message list (with the
assistant's tool calls stripped, as SGLangRollout strips them), reward_scores. `conversation_rows` turns each row
into a `ConversationRow`: the prompt's token ids (what a trainer scores the response after), the decoded response (as veRL's NaiveRewardManager decodes it for scoring), the last
assistant message, the messages with each assistant turn's tool calls put back (from the rollout's tool trace, present
when the batch was run with meta_info["final_tool_trace"] = True), the model-token mask, rewards and turn count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl import DataProto


@dataclass
class ConversationRow:
    response_text: str
    final_text: str
    messages: list[dict]
    response_ids: list[int]
    response_mask: list[int]
    rewards: dict[str, Any]
    num_turns: int
    tool_calls: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        """Tokens the model wrote (tool results and chat-template glue excluded)."""
        return sum(self.response_mask)

    def to_metadata(self) -> dict:
        """GenerationOutput.metadata of a multi-turn row (its completion is `final_text`)."""
        return {"messages": self.messages, "response_text": self.response_text, "prompt_ids": self.prompt_ids,
                "response_ids": self.response_ids,
                "response_mask": self.response_mask, "rewards": self.rewards, "num_turns": self.num_turns,
                "tool_calls": self.tool_calls, "completion_tokens": self.completion_tokens}


def conversation_rows(out: DataProto, tokenizer: Any) -> list[ConversationRow]:
    prompt_width = out.batch["prompts"].shape[-1]
    traces = out.non_tensor_batch.get("tool_calls")
    rows = []
    for i in range(len(out)):
        valid = int(out.batch["attention_mask"][i, prompt_width:].sum())
        prompt = out.batch["prompts"][i][out.batch["attention_mask"][i, :prompt_width].bool()].tolist()  # left pad
        ids = out.batch["responses"][i, :valid].tolist()
        mask = out.batch["response_mask"][i, :valid].tolist()
        trace = list(traces[i]) if traces is not None else []
        messages = _with_tool_calls([_plain(m) for m in out.non_tensor_batch["messages"][i]["messages"]], trace)
        assistant = [m["content"] for m in messages if m["role"] == "assistant"]
        rows.append(ConversationRow(
            response_text=tokenizer.decode(ids, skip_special_tokens=True),
            final_text=assistant[-1] if assistant and isinstance(assistant[-1], str) else "",
            messages=messages, response_ids=ids, response_mask=mask,
            rewards=dict(out.non_tensor_batch["reward_scores"][i]), num_turns=len(assistant), tool_calls=trace,
            prompt_ids=prompt))
    return rows


def _plain(message: Any) -> dict:
    if isinstance(message, dict):
        return dict(message)
    d = {"role": message.role, "content": message.content}
    if getattr(message, "tool_calls", None):
        d["tool_calls"] = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    return d


def _with_tool_calls(messages: list[dict], trace: list[dict]) -> list[dict]:
    """Put each assistant turn's calls back on its message (trace entries carry the message's index)."""
    for entry in trace:
        index = entry.get("message_index")
        if index is None or not 0 <= index < len(messages) or messages[index]["role"] != "assistant":
            continue
        call = {"name": entry["name"], "arguments": entry["arguments"]}
        if entry.get("error"):
            call["error"] = entry["error"]
        calls = messages[index].setdefault("tool_calls", [])
        if call not in calls:
            calls.append(call)
    return messages


def describe_event(event: dict) -> str | None:
    """One line for a MultiTurnRollout.on_event event, as `final chat --tools` prints it (None: nothing to show)."""
    import json

    if event["type"] == "tool_call":
        if event.get("error") and event.get("name") is None:
            return f"  -> (unparsable tool call: {event['error']})"
        return f"  -> {event['name']}({json.dumps(event.get('arguments'), ensure_ascii=False)})"
    if event["type"] == "tool_result":
        text = event.get("response") or ""
        return f"  <- {event.get('name')}: {text if len(text) <= 200 else text[:200] + '...'}"
    return None
