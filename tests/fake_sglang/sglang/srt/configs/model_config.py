"""Mirrors what SGLang 0.5.2's ModelConfig (sglang/srt/configs/model_config.py) reports for a text model:
context_len (server_args.context_length, else the HF config's max_position_embeddings) and vocab_size."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig


@dataclass
class ModelConfig:
    context_len: int
    vocab_size: int
    is_generation: bool = True

    @staticmethod
    def from_server_args(server_args) -> "ModelConfig":
        hf_config = AutoConfig.from_pretrained(server_args.model_path, trust_remote_code=server_args.trust_remote_code)
        text = getattr(hf_config, "text_config", hf_config)
        context_len = server_args.context_length or text.max_position_embeddings
        return ModelConfig(context_len=context_len, vocab_size=text.vocab_size)
