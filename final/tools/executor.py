"""Running veRL tools for one conversation: create / execute / calc_reward / release, never crashing the rollout.

veRL 0.6.0's SGLangRollout awaits tool coroutines bare, so a tool that raises ends the whole batch and a tool
that hangs hangs it. Here every lifecycle call runs under the tool's time limit (tools.yaml `timeout_s`); a
failure becomes a tool message ("Error: ...") the model sees on its next turn, with reward 0. Long tool
output is cut to `multi_turn.max_tool_response_length` characters exactly as veRL's ToolAgentLoop cuts it
(verl/experimental/agent_loop/tool_agent_loop.py `_call_tool`), which SGLangRollout itself never does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable

from verl.tools.schemas import ToolResponse

from final.tools.parser import ParsedCall
from final.tools.registry import ToolSet

logger = logging.getLogger(__name__)


@dataclass
class CallOutcome:
    """What one parsed call produced; `trace` is the record kept for the caller (name, arguments, error, ...)."""

    response: ToolResponse
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    executed: bool = False
    trace: dict = field(default_factory=dict)


class ToolExecutor:
    def __init__(self, toolset: ToolSet, max_parallel_calls: int = 1, max_response_length: int = 256,
                 truncate_side: str = "middle"):
        self.toolset = toolset
        self.max_parallel_calls = max_parallel_calls
        self.max_response_length = max_response_length
        self.truncate_side = truncate_side

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def create_all(self, instance_id: str, names: list[str], tools_kwargs: dict) -> list[ToolResponse]:
        """`create` each offered tool concurrently (veRL's _handle_pending_state); failures become error text."""
        async def one(name: str) -> ToolResponse:
            create_kwargs = tools_kwargs.get(name, {}).get("create_kwargs", {})
            try:
                _, response = await self._guard(name, "create", self.toolset[name].create(instance_id,
                                                                                         **create_kwargs))
                return response
            except _ToolFailure as exc:
                return ToolResponse(text=f"Error: {exc}")

        return list(await asyncio.gather(*(one(n) for n in names)))

    async def execute_turn(self, instance_id: str, calls: list[ParsedCall], tools_kwargs: dict,
                           turn: int) -> list[CallOutcome]:
        """Run the runnable calls of one assistant turn concurrently; one outcome per call, in order."""
        budget = self.max_parallel_calls
        jobs: list[Awaitable[CallOutcome]] = []
        for call in calls:
            runnable = call.ok and call.name in self.toolset
            if runnable and budget > 0:
                budget -= 1
                jobs.append(self._execute(instance_id, call, tools_kwargs, turn))
            else:
                jobs.append(self._refuse(call, turn, runnable))
        return list(await asyncio.gather(*jobs))

    async def finish(self, instance_id: str, tools_kwargs: dict) -> tuple[dict[str, float], list[dict]]:
        """calc_reward then release for every offered tool (veRL's calc_reward_and_release_fn)."""
        errors: list[dict] = []

        async def one(name: str) -> tuple[str, float]:
            tool, kwargs = self.toolset[name], tools_kwargs.get(name, {})
            reward = 0.0
            try:
                reward = await self._guard(name, "calc_reward",
                                           tool.calc_reward(instance_id, **kwargs.get("calc_reward_kwargs", {})))
            except _ToolFailure as exc:
                errors.append({"name": name, "stage": "calc_reward", "error": str(exc)})
            try:
                await self._guard(name, "release", tool.release(instance_id, **kwargs.get("release_kwargs", {})))
            except _ToolFailure as exc:
                errors.append({"name": name, "stage": "release", "error": str(exc)})
            return name, reward

        return dict(await asyncio.gather(*(one(n) for n in tools_kwargs))), errors

    # ---- one call ------------------------------------------------------------------------------------
    async def _execute(self, instance_id: str, call: ParsedCall, tools_kwargs: dict, turn: int) -> CallOutcome:
        trace = {"turn": turn, "name": call.name, "arguments": call.arguments}
        execute_kwargs = tools_kwargs.get(call.name, {}).get("execute_kwargs", {})
        try:
            result = await self._guard(call.name, "execute",
                                       self.toolset[call.name].execute(instance_id, call.arguments, **execute_kwargs))
            response, reward, metrics = _unpack(result)
        except _ToolFailure as exc:
            return self._error(str(exc), trace)
        response = self._truncate(response)
        trace.update(response=response.text, reward=reward, error=None)
        return CallOutcome(response, reward, metrics, executed=True, trace=trace)

    async def _refuse(self, call: ParsedCall, turn: int, runnable: bool) -> CallOutcome:
        trace = {"turn": turn, "name": call.name, "arguments": call.arguments, "raw": call.raw}
        if not call.ok:
            why = call.error
        elif not runnable:
            why = f"unknown tool '{call.name}'; available tools: {', '.join(self.toolset.names())}"
        else:
            why = (f"call to '{call.name}' skipped: at most {self.max_parallel_calls} tool call(s) run per turn "
                   "(rollout.multi_turn.max_parallel_calls)")
        return self._error(why, trace)

    def _error(self, message: str, trace: dict) -> CallOutcome:
        response = self._truncate(ToolResponse(text=f"Error: {message}"))
        trace.update(response=response.text, reward=0.0, error=message)
        return CallOutcome(response, 0.0, {}, executed=False, trace=trace)

    def _truncate(self, response: ToolResponse) -> ToolResponse:
        text, limit = response.text, self.max_response_length
        if not text or len(text) <= limit:
            return response
        if self.truncate_side == "left":  # veRL's naming: "left" keeps the beginning
            text = text[:limit] + "...(truncated)"
        elif self.truncate_side == "right":
            text = "(truncated)..." + text[-limit:]
        else:
            half = limit // 2
            text = text[:half] + "...(truncated)..." + text[-half:]
        return response.model_copy(update={"text": text})

    async def _guard(self, name: str, stage: str, coro: Awaitable) -> Any:
        timeout = self.toolset.timeouts.get(name)
        try:
            return await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            logger.warning("tool %s: %s timed out after %ss", name, stage, timeout)
            raise _ToolFailure(f"tool '{name}' {stage} timed out after {timeout:g}s") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool's bug is reported to the model, not raised
            logger.warning("tool %s: %s raised %s: %s", name, stage, type(exc).__name__, exc)
            raise _ToolFailure(f"tool '{name}' {stage} raised {type(exc).__name__}: {exc}") from exc


class _ToolFailure(Exception):
    pass


def _unpack(result: Any) -> tuple[ToolResponse, float, dict]:
    """BaseTool.execute returns (ToolResponse, reward, metrics); refuse anything else as a tool bug."""
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], ToolResponse)):
        raise _ToolFailure(f"execute must return (ToolResponse, reward, metrics), got {type(result).__name__}")
    response, reward, metrics = result
    return response, reward, metrics if isinstance(metrics, dict) else {}
