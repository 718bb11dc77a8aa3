"""A multi-turn call's own rendering: what MultiTurnRollout needs when a call brings its own tools
(generate(tools=[...], max_turns=N): final.outputs.CALL_TOOLS) or chat template variables
(final.outputs.TEMPLATE_KWARGS), beside veRL's AsyncRolloutRequest, which renders every turn itself with
`processing_class.apply_chat_template(messages, tools=[schema.model_dump() ...])`:
- `with_template_kwargs`: a processing class whose apply_chat_template adds the call's variables (a shallow copy:
  the same tokenizer, so veRL's isinstance checks and tokenization are unchanged);
- `FullToolSchema`: veRL's tool-schema model (what the request and the tools' `create` read) that renders the
  tool's whole JSON Schema (veRL's model keeps only flat properties);
- `call_messages`: a conversation with the fallback of final.chat_template where the template cannot render tools
  or calls (SmolLM2's ChatML), exactly as a single-turn call renders it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic import PrivateAttr
from verl.tools.schemas import OpenAIFunctionToolSchema

from final.chat_template import fallback_messages


def with_template_kwargs(processing_class: Any, kwargs: dict | None) -> Any:
    """`processing_class`, rendering with the call's chat template variables (itself when there are none)."""
    if not kwargs:
        return processing_class
    clone = copy.copy(processing_class)
    clone.apply_chat_template = functools.partial(type(processing_class).apply_chat_template, clone, **kwargs)
    return clone


class FullToolSchema(OpenAIFunctionToolSchema):
    """veRL's tool schema that dumps (renders) as the tool's full OpenAI schema."""

    _full: dict = PrivateAttr(default_factory=dict)

    @classmethod
    def of(cls, model: OpenAIFunctionToolSchema, full: dict) -> "FullToolSchema":
        schema = cls.model_validate(model.model_dump())
        schema._full = copy.deepcopy(full)
        return schema

    def model_dump(self, **kwargs: Any) -> dict:
        return copy.deepcopy(self._full)


def call_messages(tokenizer: Any, messages: list[dict], schemas: list[dict], family: str) -> list[dict]:
    """The conversation the loop starts from: the tools' fallback prompt and written-out calls where the template
    renders neither (the tools then reach the template only if it renders them)."""
    out, _ = fallback_messages(tokenizer, [dict(m) for m in messages], schemas, family)
    return out
