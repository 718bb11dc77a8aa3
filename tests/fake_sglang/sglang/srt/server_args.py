"""Mirrors sglang/srt/server_args.py (0.5.2): ServerArgs (the fields an in-process Engine reads) and PortArgs.

Field names, types and defaults are 0.5.2's. A keyword 0.5.2 does not know raises TypeError, as the real
dataclass does. Fields past the first block are the ones the fake's processes read.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from typing import List, Optional

from sglang.srt.utils import is_port_available


@dataclasses.dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: str
    tokenizer_path: Optional[str] = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    trust_remote_code: bool = False
    context_length: Optional[int] = None
    revision: Optional[str] = None

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: Optional[int] = None

    # Quantization and data type
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"

    # Memory and scheduling
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    max_prefill_tokens: int = 16384
    page_size: Optional[int] = None

    # Runtime options
    device: Optional[str] = None
    tp_size: int = 1
    pp_size: int = 1
    stream_output: bool = False
    random_seed: Optional[int] = None
    watchdog_timeout: float = 300
    dist_timeout: Optional[int] = None
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    sleep_on_idle: bool = False

    # Logging
    log_level: str = "info"
    log_requests: bool = False
    enable_metrics: bool = False

    # API related
    served_model_name: Optional[str] = None
    weight_version: str = "default"
    chat_template: Optional[str] = None
    completion_template: Optional[str] = None

    # Data parallelism
    dp_size: int = 1

    # Multi-node distributed serving
    dist_init_addr: Optional[str] = None
    nnodes: int = 1
    node_rank: int = 0

    # Kernel backend
    attention_backend: Optional[str] = None
    mm_attention_backend: Optional[str] = None
    sampling_backend: Optional[str] = None

    # Expert parallelism
    ep_size: int = 1

    # Optimization/debug options
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    enable_nccl_nvls: bool = False
    enable_symm_mem: bool = False
    enable_dp_attention: bool = False
    enable_memory_saver: bool = False
    tokenizer_worker_num: int = 1
    enable_tokenizer_batch_encode: bool = False
    numa_node: Optional[List[int]] = None

    def __post_init__(self):
        # "Set missing default values" block of 0.5.2's __post_init__.
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.device is None:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.random_seed is None:
            self.random_seed = random.randint(0, 1 << 30)
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88
        if self.page_size is None:
            self.page_size = 1

    def check_server_args(self):
        assert (self.tp_size * self.pp_size) % self.nnodes == 0, "tp_size must be divisible by number of nodes"
        assert self.base_gpu_id >= 0, "base_gpu_id must be non-negative"
        assert self.gpu_id_step >= 1, "gpu_id_step must be positive"
        # What the fake can serve (see README): one scheduler, token in / token out, page size 1.
        assert self.tp_size == self.pp_size == self.dp_size == 1, "the fake SGLang serves tp=pp=dp=1 only"
        assert self.skip_tokenizer_init, "the fake SGLang is token-in-token-out: set skip_tokenizer_init=True"
        assert self.page_size == 1, "the fake SGLang's radix cache has page_size 1"


@dataclasses.dataclass
class PortArgs:
    tokenizer_ipc_name: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str
    nccl_port: int
    rpc_ipc_name: str
    metrics_ipc_name: str
    tokenizer_worker_ipc_name: Optional[str]

    @staticmethod
    def init_new(server_args, dp_rank: Optional[int] = None) -> "PortArgs":
        if server_args.nccl_port is None:
            nccl_port = server_args.port + random.randint(100, 1000)
            while True:
                if is_port_available(nccl_port):
                    break
                if nccl_port < 60000:
                    nccl_port += 42
                else:
                    nccl_port -= 43
        else:
            nccl_port = server_args.nccl_port
        # Normal case (no dp attention): IPC within a single node.
        return PortArgs(
            tokenizer_ipc_name=f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}",
            scheduler_input_ipc_name=f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}",
            detokenizer_ipc_name=f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}",
            nccl_port=nccl_port,
            rpc_ipc_name=f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}",
            metrics_ipc_name=f"ipc://{tempfile.NamedTemporaryFile(delete=False).name}",
            tokenizer_worker_ipc_name=None,
        )
