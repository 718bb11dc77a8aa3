"""Mirrors sglang/srt/entrypoints/EngineBase.py (0.5.2): the abstract engine veRL's HTTP adapter subclasses."""

from abc import ABC, abstractmethod


class EngineBase(ABC):
    @abstractmethod
    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                 custom_logit_processor=None, return_hidden_states=None, stream=None, bootstrap_host=None,
                 bootstrap_port=None, bootstrap_room=None, data_parallel_rank=None):
        """Generate outputs based on given inputs."""

    @abstractmethod
    def flush_cache(self):
        """Flush the cache of the engine."""

    @abstractmethod
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """Update model weights with in-memory tensor data."""

    def load_lora_adapter(self, lora_name: str, lora_path: str):
        """Load a new LoRA adapter without re-launching the engine."""

    def unload_lora_adapter(self, lora_name: str):
        """Unload a LoRA adapter without re-launching the engine."""

    @abstractmethod
    def release_memory_occupation(self):
        """Release GPU memory occupation temporarily."""

    @abstractmethod
    def resume_memory_occupation(self):
        """Resume GPU memory occupation which is previously released."""

    @abstractmethod
    def shutdown(self):
        """Shutdown the engine and clean up resources."""
