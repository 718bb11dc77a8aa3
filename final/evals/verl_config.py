"""The veRL trainer config `final eval verl` reads: composed by Hydra from veRL's own trainer/config/ppo_trainer.yaml
(the user's YAML and their command-line overrides on top), then the few settings validation depends on.

    --verl-config ppo.yaml data.max_response_length=256 actor_rollout_ref.rollout.val_kwargs.n=4

A YAML with a `defaults:` list (veRL's examples: `defaults: [ppo_trainer, _self_]`) is composed as it is, veRL's
config folder added to its search path (the examples name `file://verl/trainer/config`, relative to a veRL
checkout). A YAML without one (a partial config, or the `.hydra/config.yaml` a run dumped) is put over
ppo_trainer.yaml as if it had `defaults: [ppo_trainer, _self_]`. With no YAML, ppo_trainer.yaml alone.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from final.errors import ConfigError

ROLLOUT = "actor_rollout_ref.rollout"
TRUNCATIONS = ("error", "left", "right", "middle")


@dataclass
class VerlSettings:
    """What validating on a veRL dataset reads from the trainer config (keys as veRL names them)."""

    val_files: list[str]
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    response_length: int = 512
    truncation: str = "error"
    filter_overlong_prompts: bool = False
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    need_tools_kwargs: bool = False
    val_kwargs: dict = field(default_factory=lambda: {"n": 1, "do_sample": False, "temperature": 0.0})
    multi_turn: dict = field(default_factory=dict)  # rollout.multi_turn (enable, tool_config_path, limits)
    custom_reward: dict | None = None  # {path, name, reward_kwargs} when a custom reward function is set
    reward_kwargs: dict = field(default_factory=dict)  # custom_reward_function.reward_kwargs (also for --reward-fn)

    @property
    def tools_enabled(self) -> bool:
        return bool(self.multi_turn.get("enable"))


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


def compose(verl_config: str | Path | None = None, overrides: Sequence[str] = ()) -> Any:
    """The composed trainer config (an OmegaConf DictConfig). Raises ConfigError naming the file or override."""
    from omegaconf import OmegaConf

    base = verl_config_dir()
    with tempfile.TemporaryDirectory(prefix="final-verl-config-") as tmp:
        if verl_config is None:
            folder, name, search = base, "ppo_trainer", []
        else:
            path = Path(verl_config)
            if not path.is_file():
                raise ConfigError("veRL config file not found", key="--verl-config", path=str(path))
            try:
                raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
            except Exception as exc:  # noqa: BLE001 - OmegaConf/YAML errors: say which file
                raise ConfigError(f"cannot read it: {exc}", key="--verl-config", path=str(path)) from None
            if not isinstance(raw, dict):
                raise ConfigError("must be a mapping", key="--verl-config", path=str(path))
            search = list((raw.get("hydra") or {}).get("searchpath") or [])
            if "defaults" not in raw:  # put it over ppo_trainer.yaml (see the module doc)
                raw = {"defaults": ["ppo_trainer", "_self_"], **raw}
            OmegaConf.save(OmegaConf.create(raw), Path(tmp) / "user.yaml")
            folder, name = Path(tmp), "user"
        # the examples' `file://verl/trainer/config` is relative to a veRL checkout: entries not here are dropped
        search = [s for s in search if isinstance(s, str) and (not s.startswith("file://")
                                                                or Path(s[len("file://"):]).is_dir())]
        search.append(f"file://{base}")
        quoted = ",".join(f"'{s}'" for s in search)
        return _hydra_compose(folder, name, [f"hydra.searchpath=[{quoted}]", *overrides],
                              str(verl_config) if verl_config else None)


def _hydra_compose(folder: Path, name: str, overrides: list[str], path: str | None) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # a caller inside a Hydra app: compose on our own
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            return hydra_compose(config_name=name, overrides=overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's errors (bad override, missing default) -> one typed error
        raise ConfigError(f"composing veRL's trainer config failed: {exc}", key="overrides", path=path) from None


def settings(cfg: Any, data: Sequence[str] | None = None) -> VerlSettings:
    """The settings of a composed config; `data` (--data) replaces data.val_files."""
    from omegaconf import OmegaConf

    def get(key: str, default: Any = None) -> Any:
        try:
            value = OmegaConf.select(cfg, key, default=default, throw_on_resolution_failure=True)
        except Exception as exc:  # noqa: BLE001 - an interpolation that does not resolve
            raise ConfigError(f"cannot resolve it: {exc}", key=key) from None
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    files = list(data) if data else get("data.val_files")
    if isinstance(files, str):
        files = [files]
    if not files:
        raise ConfigError("no validation data: give --data FILE or data.val_files", key="data.val_files")
    truncation = get("data.truncation", "error")
    if truncation not in TRUNCATIONS:
        raise ConfigError(f"must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}", key="data.truncation")
    val = {k: v for k, v in (get(f"{ROLLOUT}.val_kwargs") or {}).items() if not k.startswith("_")}
    multi_turn = {k: v for k, v in (get(f"{ROLLOUT}.multi_turn") or {}).items() if not k.startswith("_")}
    return VerlSettings(
        val_files=[str(f) for f in files], prompt_key=get("data.prompt_key", "prompt"),
        reward_fn_key=get("data.reward_fn_key", "data_source"),
        max_prompt_length=_positive(get("data.max_prompt_length", 512), "data.max_prompt_length"),
        response_length=_positive(get(f"{ROLLOUT}.response_length") or get("data.max_response_length", 512),
                                  f"{ROLLOUT}.response_length"),
        truncation=truncation, filter_overlong_prompts=bool(get("data.filter_overlong_prompts", False)),
        apply_chat_template_kwargs=dict(get("data.apply_chat_template_kwargs") or {}),
        need_tools_kwargs=bool(get("data.need_tools_kwargs", False)), val_kwargs={"n": 1, **val},
        multi_turn=multi_turn, custom_reward=custom_reward(get),
        reward_kwargs=custom_reward(get, any_path=True).get("reward_kwargs", {}))


def custom_reward(get: Any, any_path: bool = False) -> dict | None:
    """`reward.custom_reward_function` (veRL 0.9) or the top-level `custom_reward_function` (0.6, and 0.9's legacy
    key, which its trainer migrates), whichever names a path (any_path: or has reward_kwargs; {} if none does)."""
    for key in ("reward.custom_reward_function", "custom_reward_function"):
        spec = get(key)
        if isinstance(spec, dict) and (spec.get("path") or (any_path and spec.get("reward_kwargs"))):
            return {"path": str(spec["path"]), "name": spec.get("name") or "compute_score",
                    "reward_kwargs": dict(spec.get("reward_kwargs") or {}), "path_key": f"{key}.path",
                    "name_key": f"{key}.name"}
    return {} if any_path else None


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be a positive integer, got {value!r}", key=key)
    return value
