"""LoRA adapters: PEFT's format read and checked (format.py), and a trainer's adapter merged into the served weights
(merge.py). The embedded engine serves adapters per row (final/engine/lora.py)."""

from final.adapters.format import (Adapter, LoraModule, LoraSettings, adapter_name, adapters_per_prompt,
                                   build_adapter, check_adapter_name, check_adapters, is_adapter_folder,
                                   load_adapter_folder, peft_update, read_adapter, split_update)
from final.adapters.merge import FolderBase, LiveBase, MergedAdapter, Plan, lora_keywords

__all__ = ["Adapter", "FolderBase", "LiveBase", "LoraModule", "LoraSettings", "MergedAdapter", "Plan",
           "adapter_name", "adapters_per_prompt", "build_adapter", "check_adapter_name", "check_adapters",
           "is_adapter_folder", "load_adapter_folder", "lora_keywords", "peft_update", "read_adapter",
           "split_update"]
