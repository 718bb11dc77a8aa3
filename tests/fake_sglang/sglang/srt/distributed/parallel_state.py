"""Mirrors the names verl/third_party/sglang/parallel_state.py imports from sglang/srt/distributed/parallel_state.py
(0.5.2). veRL calls them only to build Megatron-style groups (train_tp); final runs tp=1 in-process."""

from sglang._surface import import_surface_only

get_pp_group = import_surface_only("sglang.srt.distributed.parallel_state.get_pp_group")
get_world_group = import_surface_only("sglang.srt.distributed.parallel_state.get_world_group")
init_distributed_environment = import_surface_only("sglang.srt.distributed.parallel_state.init_distributed_environment")
init_model_parallel_group = import_surface_only("sglang.srt.distributed.parallel_state.init_model_parallel_group")
