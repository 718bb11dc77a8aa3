"""tools.yaml -> live veRL tools, validated up front.

The file format is veRL 0.6.0's (verl/tools/utils/tool_registry.py), so the same file drives veRL's own
SGLangRollout:

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool   # any importable verl.tools.base_tool.BaseTool subclass
        config: {type: native}                        # passed to the tool's constructor
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}
        timeout_s: 30                                 # ours (veRL ignores it): per-call limit, default 60

veRL's loader fails deep inside OmegaConf/pydantic/importlib; here every mistake is a ToolConfigError naming the
file and the key (`tools[0].tool_schema.function.name`) before any request runs. Only `type: native` tools are
supported: veRL's `mcp` type needs MCP servers this package does not start.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from final.compat import TOOL_MODULES
from final.config import read_yaml
from final.errors import ToolConfigError
from final.tools.schema_check import schema_problem

DEFAULT_TIMEOUT_S = 60.0
_ENTRY_KEYS = {"class_name", "config", "tool_schema", "timeout_s"}


@dataclass
class ToolSet:
    """The tools of one tools.yaml: name -> BaseTool, in file order, with their per-call time limits."""

    tools: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)
    path: str | None = None
    # each tool's tool_schema as tools.yaml writes it: veRL's schema model keeps only type, description and enum of a
    # property (no pattern, bounds, nested items), and rollout.multi_turn.constrain_tool_calls holds calls to all of it
    written: dict[str, dict] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __getitem__(self, name: str) -> Any:
        return self.tools[name]

    def __len__(self) -> int:
        return len(self.tools)

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict]:
        """OpenAI tool schemas as veRL's SGLangRollout lists them (`model_dump()`)."""
        return [tool.get_openai_tool_schema().model_dump() for tool in self.tools.values()]


def load_tools(path: str | Path) -> ToolSet:
    """Read, validate and instantiate the tools of a veRL tools.yaml."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise ToolConfigError("tool config file not found", path=where)
    doc = read_yaml(path, ToolConfigError)
    if not isinstance(doc, dict) or "tools" not in doc:
        raise ToolConfigError("expected a mapping with a 'tools' list", key="tools", path=where)
    entries = doc["tools"]
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError("must be a non-empty list of tools", key="tools", path=where)
    toolset = ToolSet(path=where)
    for i, entry in enumerate(entries):
        tool, timeout = _build_tool(entry, f"tools[{i}]", where)
        if tool.name in toolset.tools:
            raise ToolConfigError(f"duplicate tool name {tool.name!r}", key=f"tools[{i}].tool_schema.function.name",
                                  path=where)
        toolset.tools[tool.name] = tool
        toolset.timeouts[tool.name] = timeout
        if isinstance(entry.get("tool_schema"), dict):
            toolset.written[tool.name] = _written_schema(entry["tool_schema"], f"tools[{i}].tool_schema", where)
    return toolset


def _written_schema(schema: dict, key: str, where: str) -> dict:
    """A tool_schema as written, its parameters checked as a JSON Schema (2020-12)."""
    parameters = (schema.get("function") or {}).get("parameters")
    problem = schema_problem(parameters if isinstance(parameters, dict) else {})
    if problem is not None:
        message, inner = problem
        raise ToolConfigError(message, path=where, key=f"{key}.function.parameters" + (f".{inner}" if inner else ""))
    return copy.deepcopy(schema)


def _build_tool(entry: Any, key: str, where: str) -> tuple[Any, float]:
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    if not isinstance(entry, dict):
        raise ToolConfigError("each tool must be a mapping with class_name, config and tool_schema", key=key,
                              path=where)
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ToolConfigError(f"unknown keys {unknown}; allowed: {sorted(_ENTRY_KEYS)}", key=key, path=where)
    cls = _import_class(entry.get("class_name"), f"{key}.class_name", where)
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"{entry['class_name']} is not a subclass of verl.tools.base_tool.BaseTool",
                              key=f"{key}.class_name", path=where)
    config = entry.get("config")
    if not isinstance(config, dict):
        raise ToolConfigError("must be a mapping with at least `type: native`", key=f"{key}.config", path=where)
    if config.get("type") != "native":
        raise ToolConfigError(f"unsupported tool type {config.get('type')!r}; only 'native' tools run here "
                              "(veRL's 'mcp' tools need MCP servers)", key=f"{key}.config.type", path=where)
    schema = None
    if entry.get("tool_schema") is not None:
        try:
            schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ToolConfigError(f"{err['msg']}", key=f"{key}.tool_schema" + (f".{loc}" if loc else ""),
                                  path=where) from exc
    timeout = entry.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
        raise ToolConfigError(f"must be a positive number of seconds, got {timeout!r}", key=f"{key}.timeout_s",
                              path=where)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # BaseTool.__init__ prints its schema
            tool = cls(config=dict(config), tool_schema=schema)
    except Exception as exc:  # noqa: BLE001 - any constructor failure is a config problem
        raise ToolConfigError(f"{entry['class_name']} could not be constructed: {type(exc).__name__}: {exc}",
                              key=key, path=where) from exc
    if not isinstance(getattr(tool, "name", None), str) or not tool.name:
        raise ToolConfigError("the tool has no name (set tool_schema.function.name)", key=f"{key}.tool_schema",
                              path=where)
    return tool, float(timeout)


def _import_class(name: Any, key: str, where: str) -> Any:
    if not isinstance(name, str) or "." not in name:
        raise ToolConfigError(f"must be a dotted path such as verl.tools.gsm8k_tool.Gsm8kTool, got {name!r}",
                              key=key, path=where)
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(TOOL_MODULES.get(module_name, module_name))
    except ImportError as exc:
        raise ToolConfigError(f"cannot import module {module_name!r}: {exc}", key=key, path=where) from exc
    if not hasattr(module, attr):
        raise ToolConfigError(f"module {module_name!r} has no class {attr!r}", key=key, path=where)
    return getattr(module, attr)
