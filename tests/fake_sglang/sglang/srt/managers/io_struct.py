"""Mirrors sglang/srt/managers/io_struct.py (0.5.2): the request/response objects between the tokenizer manager
and the scheduler, with 0.5.2's field names and GenerateReqInput's batch normalisation (text-only subset)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from sglang.srt.sampling.sampling_params import SamplingParams

MultimodalDataInputFormat = Union[List[Any], Any]


@dataclass
class GenerateReqInput:
    text: Optional[Union[List[str], str]] = None
    input_ids: Optional[Union[List[List[int]], List[int]]] = None
    input_embeds: Optional[Any] = None
    image_data: Optional[MultimodalDataInputFormat] = None
    video_data: Optional[MultimodalDataInputFormat] = None
    audio_data: Optional[MultimodalDataInputFormat] = None
    sampling_params: Optional[Union[List[Dict], Dict]] = None
    rid: Optional[Union[List[str], str]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    logprob_start_len: Optional[Union[List[int], int]] = None
    top_logprobs_num: Optional[Union[List[int], int]] = None
    token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: Union[List[bool], bool] = False
    lora_path: Optional[Union[List[Optional[str]], Optional[str]]] = None
    lora_id: Optional[Union[List[Optional[str]], Optional[str]]] = None
    custom_logit_processor: Optional[Union[List[Optional[str]], str]] = None
    bootstrap_host: Optional[Union[List[str], str]] = None
    bootstrap_port: Optional[Union[List[Optional[int]], int]] = None
    bootstrap_room: Optional[Union[List[int], int]] = None
    data_parallel_rank: Optional[int] = None

    def contains_mm_input(self) -> bool:
        def valid(data):
            if data is None:
                return False
            if isinstance(data, list):
                return any(valid(x) for x in data)
            return True

        return valid(self.image_data) or valid(self.video_data) or valid(self.audio_data)

    def normalize_batch_and_arguments(self):
        if (self.text is None and self.input_ids is None and self.input_embeds is None) or (
            self.text is not None and self.input_ids is not None and self.input_embeds is not None
        ):
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        self._determine_batch_size()
        self._handle_parallel_sampling()
        if self.is_single:
            self._normalize_single_inputs()
        else:
            self._normalize_batch_inputs()

    def _determine_batch_size(self):
        if self.text is not None:
            self.is_single = isinstance(self.text, str)
            self.batch_size = 1 if self.is_single else len(self.text)
        else:
            if len(self.input_ids) == 0:
                raise ValueError("input_ids cannot be empty.")
            self.is_single = isinstance(self.input_ids[0], int)
            self.batch_size = 1 if self.is_single else len(self.input_ids)

    def _handle_parallel_sampling(self):
        if self.sampling_params is None:
            self.parallel_sample_num = 1
            return
        elif isinstance(self.sampling_params, dict):
            self.parallel_sample_num = self.sampling_params.get("n", 1)
        else:
            self.parallel_sample_num = self.sampling_params[0].get("n", 1)
            for sampling_params in self.sampling_params:
                if self.parallel_sample_num != sampling_params.get("n", 1):
                    raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
        if self.parallel_sample_num > 1 and self.is_single:
            self.is_single = False
            if self.text is not None:
                self.text = [self.text]
            if self.input_ids is not None:
                self.input_ids = [self.input_ids]

    def _normalize_single_inputs(self):
        if self.sampling_params is None:
            self.sampling_params = {}
        if self.rid is None:
            self.rid = uuid.uuid4().hex
        if self.return_logprob is None:
            self.return_logprob = False
        if self.logprob_start_len is None:
            self.logprob_start_len = -1
        if self.top_logprobs_num is None:
            self.top_logprobs_num = 0
        if not self.token_ids_logprob:
            self.token_ids_logprob = None

    def _normalize_batch_inputs(self):
        num = self.batch_size * self.parallel_sample_num
        if self.text is not None:
            self.text = self.text * self.parallel_sample_num
        else:
            if not isinstance(self.input_ids, list) or not isinstance(self.input_ids[0], list):
                raise ValueError("input_ids should be a list of lists for batch processing.")
            self.input_ids = self.input_ids * self.parallel_sample_num
        if self.rid is None:
            self.rid = [uuid.uuid4().hex for _ in range(num)]
        elif isinstance(self.rid, str):
            self.rid = [f"{self.rid}_{i}" for i in range(num)]
        elif len(self.rid) != self.batch_size:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        for name in ("image_data", "video_data", "audio_data"):
            value = getattr(self, name)
            if value is None or (isinstance(value, list) and len(value) == 0):
                setattr(self, name, [None] * num)
            elif not isinstance(value, list):
                setattr(self, name, [value] * num)
            else:
                if len(value) != self.batch_size:
                    raise ValueError(f"The length of {name} should be equal to the batch size.")
                setattr(self, name, value * self.parallel_sample_num)
        if self.sampling_params is None:
            self.sampling_params = [{}] * num
        elif isinstance(self.sampling_params, dict):
            self.sampling_params = [self.sampling_params] * num
        else:
            self.sampling_params = self.sampling_params * self.parallel_sample_num

        def normalize_param(param, default_value, param_name):
            if param is None:
                return [default_value] * num
            elif not isinstance(param, list):
                return [param] * num
            else:
                if self.parallel_sample_num > 1:
                    raise ValueError(f"Cannot use list {param_name} with parallel_sample_num > 1")
                return param

        self.return_logprob = normalize_param(self.return_logprob, False, "return_logprob")
        self.logprob_start_len = normalize_param(self.logprob_start_len, -1, "logprob_start_len")
        self.top_logprobs_num = normalize_param(self.top_logprobs_num, 0, "top_logprobs_num")
        self.token_ids_logprob = [None] * num

    def regenerate_rid(self):
        self.rid = uuid.uuid4().hex
        return self.rid

    def __getitem__(self, i):
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            image_data=self.image_data[i],
            video_data=self.video_data[i],
            audio_data=self.audio_data[i],
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            return_logprob=self.return_logprob[i],
            logprob_start_len=self.logprob_start_len[i],
            top_logprobs_num=self.top_logprobs_num[i],
            token_ids_logprob=self.token_ids_logprob[i],
            return_text_in_logprobs=self.return_text_in_logprobs,
            stream=self.stream,
            log_metrics=self.log_metrics,
        )


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: str
    input_ids: List[int]
    mm_inputs: dict
    sampling_params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: List[int]
    stream: bool
    return_hidden_states: bool = False


@dataclass
class BatchTokenIDOut:
    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    output_ids: Optional[List[List[int]]]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    input_token_logprobs_val: List[List[Optional[float]]]
    input_token_logprobs_idx: List[List[int]]
    output_token_logprobs_val: List[List[float]]
    output_token_logprobs_idx: List[List[int]]


@dataclass
class FlushCacheReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: List[Union[str, bytes]]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


@dataclass
class UpdateWeightsFromTensorReqOutput:
    success: bool
    message: str


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: Optional[List[str]] = None


@dataclass
class ReleaseMemoryOccupationReqOutput:
    pass


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: Optional[List[str]] = None


@dataclass
class ResumeMemoryOccupationReqOutput:
    pass


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    finished_reason: Optional[Dict[str, Any]] = None
    abort_reason: Optional[str] = None


@dataclass
class RpcReqInput:
    method: str
    parameters: Optional[Dict] = None


@dataclass
class RpcReqOutput:
    success: bool
    message: str
