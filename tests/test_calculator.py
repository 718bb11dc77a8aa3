"""final.tools.calculator: exact arithmetic, nothing else evaluated, bad input answered as the tool's text; the tool
loads from a tools.yaml through final's registry and runs as veRL's BaseTool."""

from __future__ import annotations

import asyncio
import json

import pytest

from final.tools.calculator import CALCULATOR_SCHEMA, CalculationError, calculate
from final.tools.registry import load_tools


@pytest.mark.parametrize("expression, value", [
    ("37 * 48", "1776"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"), ("10 / 4 * 2", "5"), ("-3 + +5", "2"),
    ("2 ** 10", "1024"), ("17 // 5", "3"), ("17 % 5", "2"), ("0.1 + 0.2", "0.30000000000000004"), ("45 × 77", "3465"),
    (" 1/3 ", "0.3333333333333333"), ("2 ** -2", "0.25")])
def test_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "not Call"), ("x + 1", "not Name"), ("(1).real", "not Attribute"),
    ("[1, 2]", "not List"), ("'a' * 3", "not Constant"), ("True + 1", "not Constant"), ("1 +", "not an arithmetic"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "whole exponent"), ("2 ** 65", "whole exponent"), ("9" * 61, "more than 60 digits"),
    ("99999999999 ** 64", "more than 60 digits"), ("1 + " * 60 + "1", "longer than 200"), ("", "non-empty"),
    ("1e400", "more than 60 digits")])
def test_refusals_say_why(expression, why):
    with pytest.raises(CalculationError, match=why):
        calculate(expression)


def test_the_tool_from_tools_yaml(tmp_path):
    file = tmp_path / "tools.yaml"
    file.write_text(json.dumps({"tools": [{"class_name": "final.tools.calculator.CalculatorTool",
                                           "config": {"type": "native"}, "tool_schema": CALCULATOR_SCHEMA}]}))
    tool = load_tools(file)["calculator"]

    async def use() -> list:
        instance, _ = await tool.create()
        good = await tool.execute(instance, {"expression": "37 * 48"})
        bad = await tool.execute(instance, {"expression": "import os"})
        missing = await tool.execute(instance, {})
        reward = await tool.calc_reward(instance)
        await tool.release(instance)
        return [good, bad, missing, reward]

    good, bad, missing, reward = asyncio.run(use())
    assert good[0].text == "1776" and good[1] == 0.0
    assert bad[0].text.startswith("error: not an arithmetic expression") and bad[2]["error"]
    assert missing[0].text == "error: expression must be a non-empty string" and reward == 0.0
