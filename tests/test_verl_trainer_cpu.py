"""veRL 0.6.0's own trainer (`python -m verl.trainer.main_ppo`, GRPO, FSDP2 on gloo, a local Ray) on this CPU with
final's embedded engine as its in-process rollout (`rollout.name: final`, final.verl_cpu). Two steps: step 1's
optimizer step moves the actor a lot (lr 1e-2, a reward that varies between samples), so step 2's rollout matches
the actor's own log-probs (veRL's training/rollout_probs_diff_mean, within the bf16 floor of veRL's actor) only if
veRL's weight sync reached the engine through LocalRollout.update_weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from final import compat

pytestmark = [pytest.mark.skipif(compat.LANE != "verl06", reason="veRL 0.6.0's trainer (0.9 has no sync rollouts)"),
              pytest.mark.timeout(900)]

REWARD = '''
def diversity(data_source, solution_str, ground_truth, extra_info=None):
    """A reward that differs between any two different samples of one prompt, almost surely (so GRPO's advantages
    are not all zero: the count of distinct words tied between a random model's two samples in one CI run)."""
    return (sum(map(ord, solution_str)) % 101) / 100.0
'''


def _data(tmp_path, rows: int = 4) -> str:
    """veRL's RL-dataset layout (examples/data_preprocess/gsm8k.py's columns), with small problems made here."""
    import pandas as pd

    frame = pd.DataFrame([{"data_source": "openai/gsm8k", "ability": "math",
                           "prompt": [{"role": "user", "content": f"Tom has {i + 3} apples and buys {2 * i + 1} more. "
                                                                  "How many apples does he have?"}],
                           "reward_model": {"style": "rule", "ground_truth": str(3 * i + 4)},
                           "extra_info": {"index": i}} for i in range(rows)])
    path = str(tmp_path / "train.parquet")
    frame.to_parquet(path)
    return path


def _metrics(stdout: str) -> dict[int, dict[str, float]]:
    steps = {}
    for line in stdout.splitlines():
        if m := re.search(r"step:(\d+) - (.*)$", line):
            pairs = (item.split(":", 1) for item in m.group(2).split(" - ") if ":" in item)
            steps[int(m.group(1))] = {k: float(v) for k, v in pairs if re.fullmatch(r"-?[\d.e+-]+", v.strip())}
    return steps


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_verls_trainer_syncs_the_actor_into_the_embedded_engine_every_step(tiny_dir, tmp_path, lora_rank):
    """lora_rank 8: veRL's LoRA actor (PEFT, all-linear) sends the base once (load_format dummy: base_sync_done
    False, `.base_layer.` names), then only the adapter's lora_A/lora_B tensors with its peft_config, which
    LocalRollout merges into the kept base (final/adapters/merge.py); before, step 2 stopped at the unknown names.
    lora_alpha 64 (scale 8) makes step 1's move of the adapter show: measured at step 2, rollout_probs_diff_mean
    1.3e-3 synced, 7.8e-3 with the adapter updates dropped (1e-3 and 3.4e-3 at lora_alpha 16, too close)."""
    data = _data(tmp_path)
    (tmp_path / "reward.py").write_text(REWARD)
    plugin = "final.verl_cpu"
    overrides = [
        "algorithm.adv_estimator=grpo", f"data.train_files={data}", f"data.val_files={data}",
        "data.train_batch_size=2", "data.max_prompt_length=256", "data.max_response_length=16",
        "data.dataloader_num_workers=0", f"custom_reward_function.path={tmp_path / 'reward.py'}",
        "custom_reward_function.name=diversity",
        f"actor_rollout_ref.model.path={tiny_dir}", "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config._attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2", "critic.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.name=final", "actor_rollout_ref.rollout.mode=sync",
        "actor_rollout_ref.rollout.dtype=float32",  # veRL's default is bfloat16
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "algorithm.use_kl_in_reward=false",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=2", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.num_cpus=2",
        "+ray_kwargs.ray_init.include_dashboard=false",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES={plugin}",
    ] + ([f"actor_rollout_ref.model.lora_rank={lora_rank}", "actor_rollout_ref.model.lora_alpha=64"]
         if lora_rank else [])
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": plugin, "RAY_ADDRESS": "local"}
    done = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], capture_output=True, text=True,
                          timeout=800, env=env, cwd=tmp_path)
    steps = _metrics(done.stdout + done.stderr)
    assert done.returncode == 0 and set(steps) == {1, 2}, (done.stdout + done.stderr)[-6000:]
    assert steps[1]["actor/grad_norm"] > 0  # step 1 moved the actor
    # step 2 sampled from the moved actor: the engine's log-probs are the actor's own (fp32 on both sides)
    # veRL's actor computes its log-probs under bf16 autocast (dp_actor.py, hard-coded), so the mean |p_rollout -
    # p_actor| of the sampled tokens has a floor near 1e-3 however exact the engine is (measured at step 2: 6e-4 -
    # 9e-4 synced; 9e-3 - 1.1e-2 with the sync disabled)
    assert steps[2]["training/rollout_probs_diff_mean"] < 5e-3, steps[2]
