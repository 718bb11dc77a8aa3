"""Mirrors sglang/srt/entrypoints/engine.py (0.5.2): Engine, _set_envs_and_config, _launch_subprocesses.

As in 0.5.2: importing this module disables threading's atexit registration; Engine(**kwargs) builds ServerArgs
(log_level "error" unless given), registers shutdown at exit, allocates PortArgs, and `_launch_subprocesses` calls
the module globals `_set_envs_and_config` (veRL replaces it) and `run_scheduler_process` (spawned with the start
method `_set_envs_and_config` sets: spawn), waits for the scheduler's "ready", then builds the TokenizerManager in
this process. `shutdown` kills every child process of this process. 0.5.2 also sets uvloop's event loop policy at
import and starts a detokenizer process; the fake does neither (uvloop is not a test dependency; with
skip_tokenizer_init the detokenizer receives nothing).
"""

import asyncio
import atexit
import logging
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from typing import Dict, List, Optional, Tuple, Union

import zmq

# Fix a bug of Python threading
setattr(threading, "_register_atexit", lambda *args, **kwargs: None)

from sglang.srt.entrypoints.EngineBase import EngineBase  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    RpcReqInput,
    RpcReqOutput,
)
from sglang.srt.managers.scheduler import run_scheduler_process  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs  # noqa: E402
from sglang.srt.utils import (  # noqa: E402
    assert_pkg_version,
    configure_logger,
    get_zmq_socket,
    kill_process_tree,
    set_prometheus_multiproc_dir,
    set_ulimit,
)

logger = logging.getLogger(__name__)


class Engine(EngineBase):
    def __init__(self, **kwargs):
        if "server_args" in kwargs:
            server_args = kwargs["server_args"]
        else:
            if "log_level" not in kwargs:
                kwargs["log_level"] = "error"
            server_args = ServerArgs(**kwargs)

        # Shutdown the subprocesses automatically when the program exits
        atexit.register(self.shutdown)

        # Allocate ports for inter-process communications
        self.port_args = PortArgs.init_new(server_args)

        tokenizer_manager, template_manager, scheduler_info = _launch_subprocesses(
            server_args=server_args, port_args=self.port_args)
        self.server_args = server_args
        self.tokenizer_manager = tokenizer_manager
        self.template_manager = template_manager
        self.scheduler_info = scheduler_info

        context = zmq.Context(2)
        self.send_to_rpc = get_zmq_socket(context, zmq.DEALER, self.port_args.rpc_ipc_name, True)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                 token_ids_logprob=None, lora_path=None, custom_logit_processor=None, return_hidden_states=False,
                 stream=False, bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, data_parallel_rank=None):
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, image_data=image_data,
            audio_data=audio_data, video_data=video_data, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, lora_path=lora_path, custom_logit_processor=custom_logit_processor,
            return_hidden_states=return_hidden_states, stream=stream, bootstrap_host=bootstrap_host,
            bootstrap_port=bootstrap_port, bootstrap_room=bootstrap_room, data_parallel_rank=data_parallel_rank)
        loop = asyncio.get_event_loop()
        generator = self.tokenizer_manager.generate_request(obj, None)
        return loop.run_until_complete(generator.__anext__())

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                             audio_data=None, video_data=None, return_logprob=False, logprob_start_len=None,
                             top_logprobs_num=None, token_ids_logprob=None, lora_path=None,
                             custom_logit_processor=None, return_hidden_states=False, stream=False,
                             bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, data_parallel_rank=None):
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, image_data=image_data,
            audio_data=audio_data, video_data=video_data, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, lora_path=lora_path, return_hidden_states=return_hidden_states,
            stream=stream, custom_logit_processor=custom_logit_processor, bootstrap_host=bootstrap_host,
            bootstrap_port=bootstrap_port, bootstrap_room=bootstrap_room, data_parallel_rank=data_parallel_rank)
        generator = self.tokenizer_manager.generate_request(obj, None)
        if stream is True:
            return generator
        return await generator.__anext__()

    def shutdown(self):
        """Shutdown the engine"""
        kill_process_tree(os.getpid(), include_parent=False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.shutdown()
        return False

    def flush_cache(self):
        loop = asyncio.get_event_loop()
        return loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        from sglang._surface import import_surface_only

        return import_surface_only("sglang.srt.entrypoints.engine.Engine.update_weights_from_tensor")()

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        obj = ReleaseMemoryOccupationReqInput(tags=tags)
        loop = asyncio.get_event_loop()
        return loop.run_until_complete(self.tokenizer_manager.release_memory_occupation(obj, None))

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        obj = ResumeMemoryOccupationReqInput(tags=tags)
        loop = asyncio.get_event_loop()
        return loop.run_until_complete(self.tokenizer_manager.resume_memory_occupation(obj, None))

    def collective_rpc(self, method: str, **kwargs):
        obj = RpcReqInput(method=method, parameters=kwargs)
        self.send_to_rpc.send_pyobj(obj)
        recv_req = self.send_to_rpc.recv_pyobj(zmq.BLOCKY)
        assert isinstance(recv_req, RpcReqOutput)
        assert recv_req.success, recv_req.message


def _set_envs_and_config(server_args: ServerArgs):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.environ["NCCL_CUMEM_ENABLE"] = str(int(server_args.enable_symm_mem))
    if not server_args.enable_symm_mem:
        os.environ["NCCL_NVLS_ENABLE"] = str(int(server_args.enable_nccl_nvls))
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "4"
    os.environ["CUDA_MODULE_LOADING"] = "AUTO"
    os.environ["SGLANG_RUN_ID"] = f"sglang-run-{time.time()}-{random.randint(0, 100000000)}"
    if server_args.enable_metrics:
        set_prometheus_multiproc_dir()
    set_ulimit()
    if server_args.attention_backend == "flashinfer":
        assert_pkg_version("flashinfer_python", "0.3.1", "Please uninstall the old version and reinstall the latest "
                           "version by following the instructions at https://docs.flashinfer.ai/installation.html.")

    def launch_phase_sigquit_handler(signum, frame):
        logger.error("Received sigquit from a child process. It usually means the child failed.")
        kill_process_tree(os.getpid())

    signal.signal(signal.SIGQUIT, launch_phase_sigquit_handler)
    mp.set_start_method("spawn", force=True)


def _launch_subprocesses(server_args: ServerArgs, port_args: Optional[PortArgs] = None) -> Tuple:
    configure_logger(server_args)
    server_args.check_server_args()
    _set_envs_and_config(server_args)

    if port_args is None:
        port_args = PortArgs.init_new(server_args)

    scheduler_procs, scheduler_pipe_readers = [], []
    reader, writer = mp.Pipe(duplex=False)
    gpu_id = server_args.base_gpu_id
    proc = mp.Process(target=run_scheduler_process,
                      args=(server_args, port_args, gpu_id, 0, 0, 0, None, writer, None))
    proc.start()
    scheduler_procs.append(proc)
    scheduler_pipe_readers.append(reader)

    tokenizer_manager = TokenizerManager(server_args, port_args)
    template_manager = None

    scheduler_infos = []
    for i in range(len(scheduler_pipe_readers)):
        try:
            data = scheduler_pipe_readers[i].recv()
        except EOFError:
            logger.error(f"Rank {i} scheduler is dead. Please check if there are relevant logs.")
            scheduler_procs[i].join()
            logger.error(f"Exit code: {scheduler_procs[i].exitcode}")
            raise
        if data["status"] != "ready":
            raise RuntimeError("Initialization failed. Please see the error messages above.")
        scheduler_infos.append(data)

    scheduler_info = scheduler_infos[0]
    tokenizer_manager.max_req_input_len = scheduler_info["max_req_input_len"]
    return tokenizer_manager, template_manager, scheduler_info
