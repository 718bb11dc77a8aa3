"""config.yaml -> validated EngineConfig -> veRL's RolloutConfig and HFModelConfig.

Everything is checked before a model or engine starts, and each failure is a ConfigError naming the key path
(with the nearest valid name for typos and the line for YAML syntax errors). The `rollout:` section is veRL's
RolloutConfig, field for field, plus `name` choices of our own (`local`, `auto`, `tokasaurus`) and `custom`
(the Tokasaurus backend's settings, seed 000). We force the settings veRL 0.6.0 gets wrong for in-process use:
tensor_model_parallel_size=1, load_format=auto, skip_tokenizer_init=True.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from final.chat_template import REASONING_PARSERS, TOOL_CALL_PARSERS
from final.compat import check_mode
from final.errors import ConfigError, SamplingError
from final.models import model_positions
from final.sampling import Limits, check_params
from final.protocol.bodies import check_cartridge_sources
from final.protocol.cartridge_spec import check_cartridge_specs

BACKENDS = ("auto", "local", "sglang", "tokasaurus")
TOP_LEVEL = ("model_path", "tokenizer_path", "trust_remote_code", "rollout", "cartridges", "progress", "limits",
             "replicas", "ray_address", "cartridge_sources", "tool_call_parser", "reasoning_parser")
PACKAGE_CONFIG = Path(__file__).parent / "configs" / "default.yaml"  # the default when there is no config.yaml
PACKAGE_TOOLS = Path(__file__).parent / "configs" / "tools.yaml"
LOCAL_ENGINE_KEYS = {"device": str, "max_prefill_tokens": int, "random_seed": int, "quantization": str,
                     "prefix_cache": bool, "prefix_cache_mb": int}  # final/engine/prefix_cache.py
LOCAL_QUANTIZATIONS = ("int8", "bf16")  # engine_kwargs.local.quantization (null: the model dtype); final/engine/linear.py

# rollout.multi_turn keys of final's own, beside veRL's MultiTurnConfig fields (its dataclass refuses other keys):
# checked here, kept out of veRL's dataclass and set on its multi_turn object, where multi_turn_option reads them.
# key: (type, default)
MULTI_TURN_KEYS: dict[str, tuple[type, Any]] = {
    # hold every tool call the policy starts to a call of one of the row's tools, its arguments to the tool's schema
    # (tool_choice auto with every tool strict: text stays free); needs a backend that decodes under a grammar
    "constrain_tool_calls": (bool, False),
}

# Our defaults on top of RolloutConfig's (seed 003's working single-GPU config).
ROLLOUT_DEFAULTS: dict[str, Any] = {
    "name": "auto",
    "mode": "async",
    "skip_tokenizer_init": True,
    "tensor_model_parallel_size": 1,
    "load_format": "auto",
    "dtype": "auto",
    "prompt_length": 1024,
    "response_length": 512,
    "max_num_seqs": 256,
}


@dataclass
class EngineConfig:
    """A validated config: `model_path`, the `rollout:` section (veRL's RolloutConfig field for field), cartridges,
    limits and the pool's keys. Built by load_config, which checks every key before a model loads."""

    model_path: str
    rollout: dict[str, Any]
    custom: dict[str, Any] = field(default_factory=dict)
    cartridges: list[dict[str, Any]] = field(default_factory=list)
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    progress: bool = True
    limits: Limits = field(default_factory=Limits)
    replicas: int = 1  # data-parallel InferenceEngines on Ray (final.pool); 1 = this process only
    ray_address: str | None = None  # join this Ray cluster instead of starting a local one
    # the cartridge sources HTTP requests to `final serve` may name (--cartridge-sources); local: under --cartridge-dir
    cartridge_sources: tuple[str, ...] = ("local",)
    tool_call_parser: str = "auto"  # hermes, qwen25, llama3, mistral or auto (from the tokenizer): the tool-call format
    reasoning_parser: str = "auto"  # auto (<think>, </think> are tokens), qwen3, deepseek_r1, none: reasoning_content
    source: str | None = None  # the file it came from, for messages

    @property
    def backend(self) -> str:
        """`rollout.name` with `auto` resolved: sglang where CUDA and sglang are present, else local."""
        name = self.rollout["name"]
        if name != "auto":
            return name
        import torch

        return "sglang" if torch.cuda.is_available() and importlib.util.find_spec("sglang") else "local"

    def rollout_config(self):
        """veRL's RolloutConfig (what SGLangRollout and our rollouts take)."""
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import RolloutConfig

        values = {k: v for k, v in self.rollout.items() if k != "custom"}
        values["name"] = self.backend
        multi_turn, ours = split_multi_turn(values.get("multi_turn"))
        if multi_turn is not None:
            values["multi_turn"] = multi_turn
        try:
            config = omega_conf_to_dataclass(values, dataclass_type=RolloutConfig)
        except Exception as exc:  # omegaconf's own type errors, re-raised with our key path
            raise ConfigError(f"veRL rejected the rollout section: {exc}", key="rollout", path=self.source) from exc
        for key, value in ours.items():  # a new attribute: veRL's BaseConfig freezes only its fields
            setattr(config.multi_turn, key, value)
        return config

    def model_config(self, local_path: str):
        """veRL's HFModelConfig for a resolved local model folder."""
        from verl.workers.config import HFModelConfig

        return HFModelConfig(path=local_path, tokenizer_path=self.tokenizer_path or local_path,
                             trust_remote_code=self.trust_remote_code)

    def check_against_model(self, local_path: str) -> int:
        """Check lengths against the model's positions; returns max_model_len."""
        cfg = json.loads((Path(local_path) / "config.json").read_text())
        max_pos = model_positions(local_path)
        factor = (cfg.get("rope_scaling") or {}).get("factor", 1.0) if isinstance(cfg.get("rope_scaling"), dict) else 1.0
        total = self.rollout["prompt_length"] + self.rollout["response_length"]
        limit = int(max_pos * factor) if max_pos else None
        if limit is not None and total > limit:
            raise ConfigError(
                f"prompt_length + response_length = {total} exceeds the model's {limit} positions "
                f"({self.model_path})", key="rollout.response_length", path=self.source)
        max_model_len = self.rollout.get("max_model_len") or total
        if max_model_len < total:
            raise ConfigError(f"max_model_len={max_model_len} is below prompt_length + response_length = {total}",
                              key="rollout.max_model_len", path=self.source)
        return max_model_len


def split_multi_turn(section: Any) -> tuple[Any, dict[str, Any]]:
    """A rollout.multi_turn section -> (veRL's part, final's MULTI_TURN_KEYS set in it)."""
    if not isinstance(section, dict):
        return section, {}
    return ({k: v for k, v in section.items() if k not in MULTI_TURN_KEYS},
            {k: v for k, v in section.items() if k in MULTI_TURN_KEYS})


def multi_turn_option(multi_turn: Any, key: str) -> Any:
    """A MULTI_TURN_KEYS value on veRL's MultiTurnConfig (EngineConfig.rollout_config sets them), else its default."""
    return getattr(multi_turn, key, MULTI_TURN_KEYS[key][1])


def default_config_path() -> Path:
    """The config used when none is named: $FINAL_CONFIG, else ./config.yaml, else the one in the package."""
    named = os.environ.get("FINAL_CONFIG")
    if named:
        return Path(named)
    local = Path("config.yaml")
    return local if local.exists() else PACKAGE_CONFIG


def load_config(source: str | Path | dict | None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Read and validate a config file (or dict; None: default_config_path()); `overrides` are deep-merged on
    top (same shape)."""
    if source is None:
        source = default_config_path()
    path = None
    if isinstance(source, (str, Path)):
        path = str(source)
        raw = _read_yaml(Path(source))
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        raise ConfigError(f"config must be a path or a dict, got {type(source).__name__}")
    if overrides:
        raw = _deep_merge(raw, overrides)
    return _validate(raw, path)


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError("config file not found", path=str(path))
    data = read_yaml(path)
    if data is None:
        raise ConfigError("config file is empty", path=str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}", path=str(path))
    return data


def read_yaml(path: Path, error: type[ConfigError] = ConfigError) -> Any:
    """A YAML file's document (config.yaml, tools.yaml). Every way a file can be unreadable is an `error` naming
    the file: not UTF-8, a syntax error (with its line), a value YAML cannot build (a 13th month), nesting past
    Python's recursion limit."""
    where = str(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"is not UTF-8 text (bad byte at offset {exc.start})", path=where) from None
    except OSError as exc:
        raise error(f"cannot be read: {exc.strerror or exc}", path=where) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise error(f"invalid YAML: syntax error{at}: {getattr(exc, 'problem', None) or exc}", path=where) from None
    except RecursionError:
        raise error("invalid YAML: nested too deeply", path=where) from None
    except (ValueError, TypeError, OverflowError) as exc:  # safe_load builds dates and tagged scalars itself
        raise error(f"invalid YAML: a value cannot be built: {exc}", path=where) from None


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _unknown(key: str, choices, where: str, path: str | None) -> ConfigError:
    near = difflib.get_close_matches(key, list(choices), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(sorted(choices))}"
    return ConfigError(f"unknown key{hint}", key=f"{where}{key}", path=path)


def _validate(raw: dict, path: str | None) -> EngineConfig:
    for key in raw:
        if key not in TOP_LEVEL:
            raise _unknown(key, TOP_LEVEL, "", path)
    model_path = raw.get("model_path")
    if not isinstance(model_path, str) or not model_path.strip():
        raise ConfigError("is required and must be a non-empty string", key="model_path", path=path)
    for key, kind in (("tokenizer_path", str), ("trust_remote_code", bool), ("progress", bool)):
        if raw.get(key) is not None and not isinstance(raw[key], kind):
            raise ConfigError(f"must be {kind.__name__}, got {raw[key]!r}", key=key, path=path)
    section = raw.get("rollout") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"must be a mapping, got {type(section).__name__}", key="rollout", path=path)
    rollout = {**ROLLOUT_DEFAULTS, **section}
    custom = rollout.pop("custom", None) or {}
    if not isinstance(custom, dict):
        raise ConfigError("must be a mapping", key="rollout.custom", path=path)
    _check_rollout(rollout, path)
    return EngineConfig(
        model_path=model_path, rollout=rollout, custom=custom,
        cartridges=_check_cartridges(raw.get("cartridges"), path),
        tokenizer_path=raw.get("tokenizer_path"), trust_remote_code=bool(raw.get("trust_remote_code", False)),
        progress=raw.get("progress", True), limits=_check_limits(raw.get("limits"), path), source=path,
        replicas=check_replicas(raw.get("replicas", 1), path),
        ray_address=check_ray_address(raw.get("ray_address"), path),
        cartridge_sources=check_cartridge_sources(raw.get("cartridge_sources", ["local"]), path),
        tool_call_parser=_choice(raw, "tool_call_parser", TOOL_CALL_PARSERS, path),
        reasoning_parser=_choice(raw, "reasoning_parser", REASONING_PARSERS, path),
    )


def _choice(raw: dict, key: str, choices: tuple[str, ...], path: str | None) -> str:
    value = raw.get(key, "auto")
    if value not in choices:
        raise ConfigError(f"must be one of {', '.join(choices)}, got {value!r}", key=key, path=path)
    return value


def _check_limits(value: Any, path: str | None) -> Limits:
    """`limits:` — bounds on the work and memory requests may take (final.sampling.Limits): positive integers,
    deadline_s a positive number of seconds or null, max_cartridge_bytes null for no bound."""
    if value is None:
        return Limits()
    if not isinstance(value, dict):
        raise ConfigError(f"must be a mapping, got {type(value).__name__}", key="limits", path=path)
    names = [f.name for f in dataclasses.fields(Limits)]
    for key, item in value.items():
        if key not in names:
            raise _unknown(str(key), names, "limits.", path)
        check_limit(key, item, path)
    return Limits(**value)


def check_limit(key: str, item: Any, path: str | None = None) -> None:
    """One `limits:` value (the config's, or a `final serve` flag's)."""
    if key in ("deadline_s", "cartridge_fetch_s"):
        if item is not None and (isinstance(item, bool) or not isinstance(item, (int, float))
                                 or not 0 < item < math.inf):
            raise ConfigError(f"must be a positive number of seconds (or null), got {item!r}", key=f"limits.{key}",
                              path=path)
    elif key == "max_cartridge_bytes" and item is None:
        return
    elif isinstance(item, bool) or not isinstance(item, int) or item < 1:
        raise ConfigError(f"must be a positive integer, got {item!r}", key=f"limits.{key}", path=path)


def check_replicas(value: Any, path: str | None = None) -> int:
    """`replicas`: a positive integer (the config key, open_engine's and the CLI's --replicas)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be a positive integer (InferenceEngines on Ray; 1 = in this process), got {value!r}",
                          key="replicas", path=path)
    return value


def check_ray_address(value: Any, path: str | None = None) -> str | None:
    """`ray_address`: null (start a local Ray when replicas > 1) or a cluster address such as 10.0.0.1:6379."""
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"must be a Ray cluster address like 10.0.0.1:6379 (or null), got {value!r}",
                          key="ray_address", path=path)
    return value


def _check_rollout(rollout: dict, path: str | None) -> None:
    from verl.workers.config import RolloutConfig

    multi_turn, ours = split_multi_turn(rollout.get("multi_turn"))
    for key, value in ours.items():
        kind = MULTI_TURN_KEYS[key][0]
        if not _matches(value, kind):
            raise ConfigError(f"must be {_describe(kind)}, got {value!r}", key=f"rollout.multi_turn.{key}", path=path)
    _check_fields({**rollout, "multi_turn": multi_turn}, RolloutConfig, "rollout.", path, skip={"name"})
    _check_sampling_defaults(rollout, path)
    if rollout["name"] not in BACKENDS:
        raise ConfigError(f"must be one of {', '.join(BACKENDS)}, got {rollout['name']!r}", key="rollout.name", path=path)
    check_mode(rollout["mode"], path)
    if rollout["mode"] == "async" and not rollout["skip_tokenizer_init"]:
        raise ConfigError("async mode requires skip_tokenizer_init: true (token-in-token-out)",
                          key="rollout.skip_tokenizer_init", path=path)
    if rollout["tensor_model_parallel_size"] != 1:
        raise ConfigError(f"must be 1: final runs a single-rank engine in-process, got "
                          f"{rollout['tensor_model_parallel_size']}", key="rollout.tensor_model_parallel_size", path=path)
    for key in ("prompt_length", "response_length", "max_num_seqs"):
        if rollout[key] < 1:
            raise ConfigError(f"must be >= 1, got {rollout[key]}", key=f"rollout.{key}", path=path)
    if not 0.0 < rollout.get("gpu_memory_utilization", 0.5) <= 1.0:
        raise ConfigError("must be in (0, 1]", key="rollout.gpu_memory_utilization", path=path)
    local = (rollout.get("engine_kwargs") or {}).get("local") or {}
    for key, value in local.items():
        if key not in LOCAL_ENGINE_KEYS:
            raise _unknown(key, LOCAL_ENGINE_KEYS, "rollout.engine_kwargs.local.", path)
        if key == "quantization" and value is None:
            continue
        if key == "quantization" and value not in LOCAL_QUANTIZATIONS:
            raise ConfigError(f"must be one of {list(LOCAL_QUANTIZATIONS)} or null, got {value!r}",
                              key="rollout.engine_kwargs.local.quantization", path=path)
        kind = LOCAL_ENGINE_KEYS[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"must be {kind.__name__}, got {value!r}", key=f"rollout.engine_kwargs.local.{key}",
                              path=path)
        if key == "prefix_cache_mb" and value < 0:
            raise ConfigError(f"must be >= 0 (0 keeps nothing), got {value}", key=f"rollout.engine_kwargs.local.{key}",
                              path=path)


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")


def _check_sampling_defaults(rollout: dict, path: str | None) -> None:
    """The rollout's default sampling and its val_kwargs go into every request: SGLang's value rules now, so a
    NaN temperature in the config is a ConfigError at start rather than a refused request later."""
    sections = (("rollout.", rollout), ("rollout.val_kwargs.", rollout.get("val_kwargs") or {}))
    for where, values in sections:
        for key in SAMPLING_DEFAULTS:
            if values.get(key) is None:
                continue
            try:
                check_params({key: values[key]})
            except SamplingError as exc:
                raise ConfigError(exc.reason, key=f"{where}{key}", path=path) from None


def _check_fields(values: dict, cls: type, where: str, path: str | None, skip: set[str] = frozenset()) -> None:
    """Unknown keys and wrong types against a veRL config dataclass (recursing into nested dataclasses)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    for key, value in values.items():
        if key not in names:
            raise _unknown(key, names, where, path)
        if key in skip:
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"must be a mapping, got {value!r}", key=f"{where}{key}", path=path)
            _check_fields(value, hint, f"{where}{key}.", path)
        elif not _matches(value, hint):
            raise ConfigError(f"must be {_describe(hint)}, got {value!r}", key=f"{where}{key}", path=path)


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # NaN and inf pass every comparison check below them: only finite numbers
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, dict) or hint in (list, dict):
        return isinstance(value, origin or hint)
    return True


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is float:
        return "float (a finite number)"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check_cartridges(value: Any, path: str | None) -> list[dict]:
    return check_cartridge_specs(value, path)
