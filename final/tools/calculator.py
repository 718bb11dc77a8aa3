"""A calculator tool for multi-turn rollouts: `final.tools.calculator.CalculatorTool` in tools.yaml.

It evaluates one arithmetic expression exactly: numbers, + - * / // % **, unary signs and parentheses, nothing else
(the expression is parsed with `ast` and walked; no name, call or attribute is ever evaluated). A result is an
integer where the value is whole ("1776", "4.5" otherwise). Bad input (not arithmetic, division by zero, a power or
a number too large) comes back as the tool's text, "error: ...", so the policy reads what went wrong and the rollout
goes on. The tool gives no reward of its own (0.0): a task's reward scores the answer.

    tools:
      - class_name: final.tools.calculator.CalculatorTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calculator, ...}}   # CALCULATOR_SCHEMA

examples/grpo.py --tools trains a policy to use it.
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_CHARS = 200  # an expression longer than this is refused
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly (+ - * / and parentheses), e.g. 37 * 48",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "the arithmetic expression, e.g. (12 + 7) * 3",
                       # what calculate() reads (its ×/÷ aside): under a constraint a call holds only these
                       "pattern": r"^[0-9 .+\-*/%()]+$", "maxLength": MAX_CHARS}},
        "required": ["expression"]}}}
MAX_DIGITS = 60  # a number (operand or result) with more digits is refused
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression, as text; CalculationError when it is not one."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculationError("expression must be a non-empty string")
    if len(expression) > MAX_CHARS:
        raise CalculationError(f"expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise CalculationError(f"not an arithmetic expression: {expression!r:.60}") from None
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return repr(float(value))


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if not math.isfinite(node.value):  # 1e400 parses as inf
            raise CalculationError(f"a number has more than {MAX_DIGITS} digits")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculationError("division by zero")
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 64:
                raise CalculationError("a power takes a whole exponent of at most 64")
            if left == 0 and right < 0:
                raise CalculationError("division by zero")
        return _bounded(BINARY[type(node.op)](left, right))
    raise CalculationError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise CalculationError(f"a number has more than {MAX_DIGITS} digits")
    return value


class CalculatorTool(BaseTool):
    """veRL BaseTool: execute({"expression": ...}) -> the value as text (or "error: ..."), reward 0.0."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instances: dict[str, int] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = 0
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict]:
        self._instances[instance_id] = self._instances.get(instance_id, 0) + 1
        try:
            text = calculate(parameters.get("expression"))
        except CalculationError as e:
            return ToolResponse(text=f"error: {e}"), 0.0, {"error": str(e)}
        return ToolResponse(text=text), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
