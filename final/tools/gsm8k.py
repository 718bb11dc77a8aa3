"""veRL 0.6.0's `verl.tools.gsm8k_tool.Gsm8kTool`, for the veRL 0.9 lane, which removed that module.

final's shipped tools.yaml (and veRL 0.6.0's GSM8K recipe) name `verl.tools.gsm8k_tool.Gsm8kTool`; on the verl09
lane final.compat.TOOL_MODULES resolves that module to this one, so the same tools.yaml loads on both lanes. The
class is veRL 0.6.0's (Apache-2.0, Bytedance Ltd. and/or its affiliates) line for line, on veRL's BaseTool and
GSM8K scorer, which 0.9.1 still ships unchanged.
"""

from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.reward_score import gsm8k
from verl.utils.rollout_trace import rollout_trace_op


class Gsm8kTool(BaseTool):
    """The reward of a GSM8K answer: 1.0 if the parsed answer is the ground truth, else 0.0; each submission that
    does not improve on the last costs 0.05 (veRL's tool reward)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float,
                                                                                                   dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # penalty for a submission that does not improve
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                                   score=1.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del self._instance_dict[instance_id]
