"""final's embedded engine as veRL 0.6.0's in-process (hybrid) rollout: `rollout.name: final, mode: sync` in veRL's
own registry (final.verl_replica, the plug-in module), built by veRL's own `get_rollout_class` with the config
dataclasses its FSDP worker makes, then driven as `ActorRolloutRefWorker.rollout_mode()` / `trainer_mode()` drive
it each step: resume(["weights"]), update_weights(the actor's state dict through veRL's convert_weight_keys, one
(name, tensor) at a time), resume(["kv_cache"]), generate_sequences(DataProto), release()."""

from __future__ import annotations

import asyncio

import pytest
import torch

from final import compat
from weights_helpers import hf_greedy, perturbed

pytestmark = pytest.mark.skipif(compat.LANE != "verl06", reason="veRL 0.9 has no sync (hybrid in-process) rollouts")


def test_verls_worker_sync_drives_the_embedded_engine(tiny_dir):
    import final.verl_replica  # noqa: F401 - the plug-in registers ("final", "sync")
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from verl import DataProto
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.model import convert_weight_keys
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from final import process_group as dist
    from final.prompts import Prompt, build_dataproto
    from final.rollout.local import LocalRollout

    cls = get_rollout_class("final", "sync")
    assert cls is LocalRollout
    rollout_cfg = omega_conf_to_dataclass(OmegaConf.create({
        "name": "final", "mode": "sync", "tensor_model_parallel_size": 1, "prompt_length": 16, "response_length": 8,
        "dtype": "float32", "load_format": "auto", "free_cache_engine": True, "calculate_log_probs": True}),
        dataclass_type=RolloutConfig)
    model_cfg = omega_conf_to_dataclass(OmegaConf.create({"path": tiny_dir}), dataclass_type=HFModelConfig)
    dist.ensure_process_group()
    mesh = init_device_mesh("cpu", mesh_shape=(1, 1, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    rollout = cls(config=rollout_cfg, model_config=model_cfg, device_mesh=mesh)
    try:
        asyncio.run(rollout.release())  # trainer_mode() at the end of _build_rollout
        actor = perturbed(tiny_dir, scale=0.5, seed=41)  # the actor after an optimizer step
        for step in range(2):
            params = convert_weight_keys(actor.state_dict(), actor)

            async def rollout_mode():
                await rollout.resume(tags=["weights"])
                await rollout.update_weights(((k, v) for k, v in params.items()), peft_config=None,
                                             base_sync_done=True)
                await rollout.resume(tags=["kv_cache"])

            asyncio.run(rollout_mode())
            ids = [[1, 17, 99, 4], [1, 5]]
            data = build_dataproto(ids, [Prompt(ids=i) for i in ids], 2, [2], meta_info={"do_sample": False})
            out: DataProto = rollout.generate_sequences(data)
            got = [row[:8].tolist() for row in out.batch["responses"]]
            assert got == [r + [2] * (8 - len(r)) for r in hf_greedy(actor, ids, 8)]
            asyncio.run(rollout.release())  # trainer_mode()
            assert rollout.engine.call(lambda _r: rollout.engine.cache.nbytes) == 0
            with torch.no_grad():  # the next step's actor
                for p in actor.parameters():
                    p.mul_(1.01)
        with pytest.raises(Exception, match="lora_A"):  # LoRA adapters are not served: merged weights are
            asyncio.run(rollout.update_weights(iter([("model.layers.0.self_attn.q_proj.lora_A.weight",
                                                      torch.zeros(4, 64))])))
    finally:
        rollout.shutdown()
