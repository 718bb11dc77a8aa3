"""Mirrors sglang/srt/function_call/function_call_parser.py (0.5.2) and the detectors it registers.

veRL picks the parser by walking ToolCallParserEnum in order and taking the first whose bot/eot tokens are in the
tokenizer's vocabulary, so the enum keeps 0.5.2's order and each detector its 0.5.2 tokens
(sglang/srt/function_call/*_detector.py). Parsing is implemented for the Qwen 2.5 / Qwen 3 / hermes format
(qwen25_detector.py, base_format_detector.py), the one the supported models emit; other formats are detection only.
"""

import json
import logging
import re
from typing import Any, Dict, List, Tuple, Type

from sglang._surface import NotInFakeSGLang
from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem

logger = logging.getLogger(__name__)


class BaseFormatDetector:
    """base_format_detector.py: token configuration and the JSON action -> ToolCallItem mapping."""

    def __init__(self):
        self.bot_token = ""
        self.eot_token = ""
        self.tool_call_separator = ", "

    def _get_tool_indices(self, tools: List[Tool]) -> Dict[str, int]:
        return {tool.function.name: i for i, tool in enumerate(tools) if tool.function.name}

    def parse_base_json(self, action: Any, tools: List[Tool]) -> List[ToolCallItem]:
        tool_indices = self._get_tool_indices(tools)
        if not isinstance(action, list):
            action = [action]
        results = []
        for act in action:
            name = act.get("name")
            if name and name in tool_indices:
                results.append(ToolCallItem(
                    tool_index=-1,  # Caller should update this based on the actual tools array called
                    name=name,
                    parameters=json.dumps(act.get("parameters") or act.get("arguments", {}), ensure_ascii=False),
                ))
            else:
                logger.warning(f"Model attempted to call undefined function: {name}")
        return results

    def has_tool_call(self, text: str) -> bool:
        return self.bot_token in text

    def detect_and_parse(self, text: str, tools: List[Tool]) -> StreamingParseResult:
        raise NotInFakeSGLang(f"{type(self).__name__}: the fake SGLang parses only the qwen25 (hermes) format")


class Qwen25Detector(BaseFormatDetector):
    """qwen25_detector.py: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call."""

    def __init__(self):
        super().__init__()
        self.bot_token = "<tool_call>\n"
        self.eot_token = "\n</tool_call>"
        self.tool_call_separator = "\n"

    def detect_and_parse(self, text: str, tools: List[Tool]) -> StreamingParseResult:
        idx = text.find(self.bot_token)
        normal_text = text[:idx].strip() if idx != -1 else text
        if self.bot_token not in text:
            return StreamingParseResult(normal_text=normal_text, calls=[])
        pattern = rf"{re.escape(self.bot_token)}(.*?){re.escape(self.eot_token)}"
        calls = []
        for match_result in re.findall(pattern, text, re.DOTALL):
            try:
                parsed_call = json.loads(match_result.strip())
                calls.extend(self.parse_base_json(parsed_call, tools))
            except json.JSONDecodeError as e:
                logger.warning(f"Failed to parse JSON part: {match_result}, JSON parse error: {str(e)}")
                continue
        return StreamingParseResult(normal_text=normal_text, calls=calls)


def _detector(name: str, bot: str, eot: str) -> Type[BaseFormatDetector]:
    def __init__(self):
        BaseFormatDetector.__init__(self)
        self.bot_token, self.eot_token = bot, eot

    return type(name, (BaseFormatDetector,), {"__init__": __init__})


Llama32Detector = _detector("Llama32Detector", "<|python_tag|>", "")
MistralDetector = _detector("MistralDetector", "[TOOL_CALLS] [", "]")
DeepSeekV3Detector = _detector("DeepSeekV3Detector", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DeepSeekV31Detector = _detector("DeepSeekV31Detector", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
PythonicDetector = _detector("PythonicDetector", "", "")
KimiK2Detector = _detector("KimiK2Detector", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
Qwen3CoderDetector = _detector("Qwen3CoderDetector", "", "")
Glm4MoeDetector = _detector("Glm4MoeDetector", "<tool_call>", "</tool_call>")
Step3Detector = _detector("Step3Detector", "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>")
GptOssDetector = _detector("GptOssDetector", "<|start|>assistant<|channel|>commentary", "<|call|>")


class FunctionCallParser:
    ToolCallParserEnum: Dict[str, Type[BaseFormatDetector]] = {
        "llama3": Llama32Detector,
        "qwen25": Qwen25Detector,
        "mistral": MistralDetector,
        "deepseekv3": DeepSeekV3Detector,
        "deepseekv31": DeepSeekV31Detector,
        "pythonic": PythonicDetector,
        "kimi_k2": KimiK2Detector,
        "qwen3_coder": Qwen3CoderDetector,
        "glm45": Glm4MoeDetector,
        "step3": Step3Detector,
        "gpt-oss": GptOssDetector,
    }

    def __init__(self, tools: List[Tool], tool_call_parser: str):
        detector_class = self.ToolCallParserEnum.get(tool_call_parser)
        if not detector_class:
            raise ValueError(f"Unsupported tool_call_parser: {tool_call_parser}")
        self.detector = detector_class()
        self.tools = tools

    def has_tool_call(self, text: str) -> bool:
        return self.detector.has_tool_call(text)

    def parse_non_stream(self, full_text: str) -> Tuple[str, list[ToolCallItem]]:
        parsed_result = self.detector.detect_and_parse(full_text, self.tools)
        tool_call_list = parsed_result.calls
        if tool_call_list:
            return parsed_result.normal_text, tool_call_list
        return full_text, []
