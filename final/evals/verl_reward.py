"""Rewards and validation metrics as veRL's trainer computes them.

- The reward function is veRL's: `default_compute_score`, or the user's `custom_reward_function` (path + name +
  reward_kwargs) loaded by veRL's own `get_custom_reward_fn` (verl/trainer/ppo/reward.py), and called as its
  NaiveRewardManager calls it: `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)` on the
  response decoded with special tokens skipped, extra_info being the row's plus `num_turns` and
  `rollout_reward_scores` (the tools' rewards). A dict result gives `score` as the reward and every key as extra
  info; the reward goes through veRL's float32 reward tensor.
- The metrics are `verl.trainer.ppo.metric_utils.process_validation_metrics` over the samples (grouped by data
  source and prompt uid, its bootstrap seed), named as RayPPOTrainer._validate names them: `val-core/{data_source}/
  {var}/{metric}` for the core variable's (`acc` if reported, else `reward`) mean/maj/best at the largest n, every
  other metric `val-aux/...`.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from final.compat import REWARD_NUMBER_AS_ACC
from final.errors import ConfigError, DataError

CUSTOM_MODULE = "custom_module"  # veRL 0.6.0 caches the file it loads under this sys.modules name


@dataclass
class Scorer:
    """compute_score as NaiveRewardManager calls it; `custom` is the custom_reward_function spec, or None."""

    fn: Callable[..., Any]
    custom: dict | None = None

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict
                 ) -> tuple[float, dict]:
        """-> (the reward as veRL's reward tensor holds it, the reward's extra info)."""
        import numpy as np

        result = self.fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                         extra_info=extra_info)
        if inspect.isawaitable(result):  # veRL 0.9 takes async reward functions too
            result = asyncio.run(result)
        if isinstance(result, dict):
            if "score" not in result:
                raise ConfigError(f"returned a dict without 'score' (keys: {', '.join(map(str, result))})",
                                  key=(self.custom or {}).get("name_key"), path=(self.custom or {}).get("path"))
            reward, extra = result["score"], dict(result)
        else:
            reward, extra = result, ({"acc": result} if REWARD_NUMBER_AS_ACC else {})
        return float(np.float32(reward)), extra


def load_scorer(custom: dict | None) -> Scorer:
    """veRL's default_compute_score, or the custom function loaded by veRL's get_custom_reward_fn. A file that is
    missing, fails to import or lacks the function is a ConfigError naming the key, before any generation."""
    if custom is None:
        from verl.utils.reward_score import default_compute_score

        return Scorer(default_compute_score)
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    spec = {k: custom[k] for k in ("path", "name", "reward_kwargs")}
    # 0.6.0 reads config.custom_reward_function, 0.9 config.reward.custom_reward_function: give both
    cfg = OmegaConf.create({"custom_reward_function": spec, "reward": {"custom_reward_function": spec}})
    path = custom["path"]
    path_key = custom.get("path_key", "custom_reward_function.path")
    name_key = custom.get("name_key", "custom_reward_function.name")
    sys.modules.pop(CUSTOM_MODULE, None)  # a file loaded earlier in this process would be reused instead
    try:
        fn = get_custom_reward_fn(cfg)
    except FileNotFoundError:
        raise ConfigError("reward function file not found", key=path_key, path=path) from None
    except AttributeError:
        raise ConfigError(f"no function {custom['name']!r} in the file", key=name_key, path=path) from None
    except Exception as exc:  # noqa: BLE001 - veRL wraps the import's error in RuntimeError (0.6) or re-raises
        sys.modules.pop(CUSTOM_MODULE, None)
        cause = exc.__cause__ or exc
        raise ConfigError(f"importing the reward function file failed: {type(cause).__name__}: {cause}",
                          key=path_key, path=path) from None
    return Scorer(fn, dict(custom))


def check_sources(scorer: Scorer, rows: list, column: str = "data_source") -> None:
    """With veRL's default scorer, every data source must have one: each is tried once on an empty answer
    (NotImplementedError: none; ImportError: its scorer's package is missing). A custom function scores
    whatever it likes, so it is not probed."""
    if scorer.custom is not None:
        return
    seen: set[str] = set()
    for r in rows:
        if r.data_source in seen:
            continue
        seen.add(r.data_source)
        try:
            scorer.fn(data_source=r.data_source, solution_str="", ground_truth=r.ground_truth,
                      extra_info=dict(r.extra_info))
        except NotImplementedError:
            raise DataError(f"no scorer for data source {r.data_source!r} in veRL's default_compute_score; give "
                            "a custom_reward_function (--reward-fn FILE) that scores it", path=r.path,
                            row=r.file_row, column=column) from None
        except ImportError as exc:
            raise DataError(f"veRL's scorer for {r.data_source!r} cannot run: {exc}", path=r.path, row=r.file_row,
                            column=column) from None
        except Exception:  # noqa: BLE001,S110 - an empty answer is no fair test of a scorer that exists
            pass


def validation_metrics(records: list[dict]) -> dict[str, float]:
    """veRL's validation metrics of the samples (records with data_source, uid, sample, score and
    reward_extra_info), exactly as RayPPOTrainer._validate computes and names them."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    records = sorted(records, key=lambda r: (r["row"], r["sample"]))
    infos: dict[str, list] = defaultdict(list)
    infos["reward"] = [r["score"] for r in records]
    for r in records:
        for key, value in r["reward_extra_info"].items():
            infos[key].append(value)
    ragged = [k for k, v in infos.items() if len(v) != len(records)]
    if ragged:  # veRL's trainer asserts on this
        raise ConfigError(f"the reward function returned extra info {ragged[0]!r} for {len(infos[ragged[0]])} of "
                          f"{len(records)} samples: return a dict (with the same keys) for every sample, or a number "
                          "for every sample", key="custom_reward_function.name")
    by_source = process_validation_metrics([r["data_source"] for r in records], [r["uid"] for r in records],
                                           dict(infos))
    return name_metrics(by_source)


def name_metrics(by_source: dict) -> dict[str, float]:
    """process_validation_metrics' nested dict -> veRL's flat val-core / val-aux names (RayPPOTrainer._validate)."""
    metrics: dict[str, float] = {}
    for source, var2metric2val in by_source.items():
        core_var = "acc" if "acc" in var2metric2val else "reward"
        for var, metric2val in var2metric2val.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric2val)
            for name, value in metric2val.items():
                core = (var == core_var and any(name.startswith(p) for p in ("mean", "maj", "best"))
                        and f"@{n_max}" in name)
                metrics[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(value)
    return metrics


def format_metrics(metrics: dict[str, float]) -> str:
    """The metrics as a two-column table, val-core first."""
    if not metrics:
        return "(no metrics)"
    keys = sorted(metrics, key=lambda k: (not k.startswith("val-core"), k))
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {metrics[k]:.4f}" for k in keys)
