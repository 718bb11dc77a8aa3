"""Real veRL BaseTool subclasses with deliberate behaviours, for multi-turn tests (referenced by class_name in
tools.yaml files the tests write; tests/ is on sys.path under pytest)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse


class EchoTool(BaseTool):
    """Answers with its arguments; records every lifecycle call with its kwargs."""

    def __init__(self, config: dict, tool_schema: Any):
        super().__init__(config, tool_schema)
        self.log: list[tuple] = []
        self.loops: set[int] = set()

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        self.log.append(("create", instance_id, kwargs))
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        self.log.append(("execute", instance_id, parameters, kwargs))
        self.loops.add(id(asyncio.get_running_loop()))
        return ToolResponse(text="echo " + json.dumps(parameters, sort_keys=True)), 0.5, {"echoed": 1}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        self.log.append(("calc_reward", instance_id, kwargs))
        return 0.25

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.log.append(("release", instance_id, kwargs))


class RaisingTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        raise RuntimeError("boom")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        raise ValueError("no reward today")


class HangingTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        await asyncio.sleep(3600)
        return ToolResponse(text="never"), 0.0, {}


class BigTool(BaseTool):
    """Returns `config.size` characters: a head, a body of x, a tail (megabytes by default)."""

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        size = int(self.config.get("size", 2_000_000))
        return ToolResponse(text="HEAD" + "x" * (size - 8) + "TAIL"), 0.0, {}


class RendezvousTool(BaseTool):
    """Each call waits until `config.expected` calls are inside execute at once: only concurrent calls finish."""

    def __init__(self, config: dict, tool_schema: Any):
        super().__init__(config, tool_schema)
        self.inside = 0
        self.all_in = asyncio.Event()

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        self.inside += 1
        if self.inside >= int(self.config.get("expected", 2)):
            self.all_in.set()
        await self.all_in.wait()
        return ToolResponse(text=f"met {parameters.get('who')}"), 0.0, {}


class BadReturnTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> Any:
        return "not a tuple"


class NotATool:
    def __init__(self, config: dict, tool_schema: Any):
        pass


class BrokenInitTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Any):
        raise RuntimeError("cannot start")


def schema(name: str, prop: str = "x") -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object",
                                                            "properties": {prop: {"type": "string"}},
                                                            "required": [prop]}}}
