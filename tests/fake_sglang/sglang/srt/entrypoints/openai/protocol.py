"""Mirrors sglang/srt/entrypoints/openai/protocol.py (0.5.2): the Tool / Function models veRL validates tool
schemas with, and ToolChoice (imported by the function-call parser)."""

from typing import Literal, Optional

from pydantic import BaseModel, Field


class Function(BaseModel):
    """Function descriptions."""

    description: Optional[str] = Field(default=None, examples=[None])
    name: Optional[str] = None
    parameters: Optional[object] = None
    strict: bool = False


class Tool(BaseModel):
    """Function wrapper."""

    type: str = Field(default="function", examples=["function"])
    function: Function


class ToolChoiceFuncName(BaseModel):
    """The name of tool choice function."""

    name: Optional[str] = None


class ToolChoice(BaseModel):
    """The tool choice definition."""

    function: ToolChoiceFuncName
    type: Literal["function"] = Field(default="function", examples=["function"])
