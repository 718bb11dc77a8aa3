"""LoRA adapters in PEFT's format: what an adapter folder or a trainer's adapter tensors are, read and checked.

A PEFT adapter folder holds `adapter_config.json` (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern,
target_modules, ...) and `adapter_model.safetensors` with one pair per adapted module,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] (a PeftModel's own state dict
adds the adapter's name: `...lora_A.default.weight`; veRL's trainer sends PEFT's saved names). The module's weight
is served as W + scale * B @ A with scale = alpha / r (alpha / sqrt(r) with use_rslora), r and alpha taken per
module from rank_pattern / alpha_pattern when a pattern matches (PEFT's own rule: the pattern matches the module
name's end, after a dot).

final applies LoRA to the projections of a decoder layer (q/k/v/o, gate/up/down): what PEFT's "all-linear" and
veRL's target_modules reach in the models the engine serves. What it cannot apply is refused before anything is
used, naming the cause: a config option (DoRA, trained biases, modules_to_save, trainable tokens...: AdapterError
naming the key) or a tensor (an unknown module, a wrong shape, a rank other than the config's, a lone A or B, NaN:
WeightsError naming the tensor). PEFT's fan_in_fan_out applies to GPT-2's Conv1D only; on an nn.Linear PEFT itself
turns it off, and so does this reader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from final.errors import AdapterError, UnsupportedError, WeightsError
from final.protocol.cartridge_spec import name_problem, shown
from final.weights import NamedTensors, check_update

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+?)\.lora_(?P<part>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
# config keys whose non-default value changes what the adapter computes beyond W + scale * B @ A
_REFUSED = {"use_dora": False, "lora_bias": False, "modules_to_save": None, "trainable_token_indices": None,
            "target_parameters": None, "layer_replication": None, "alora_invocation_tokens": None,
            "use_qalora": False, "megatron_config": None}


@dataclass(frozen=True)
class LoraSettings:
    """An adapter's numbers from its config: rank, alpha and their per-module patterns."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: Any = None  # as the config says (informational: the tensors say which modules are adapted)

    @classmethod
    def from_config(cls, config: Any, path: str | None = None) -> "LoraSettings":
        """A PEFT LoraConfig, its dict (adapter_config.json, veRL's peft_config) or a dataclass of those fields."""
        raw = _as_dict(config, path)
        if str(raw.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.") != "LORA":
            raise AdapterError(f"is {raw.get('peft_type')!r}; final serves LoRA adapters", field="peft_type",
                               path=path)
        for key, default in _REFUSED.items():
            if raw.get(key, default) not in (default, [], {}, False, None):
                raise AdapterError(f"is {raw[key]!r}: final serves plain LoRA (W + scale * B @ A), not this option",
                                   field=key, path=path)
        if str(raw.get("bias", "none")) != "none":
            raise AdapterError(f"is {raw['bias']!r}: final serves adapters without trained biases (bias: none)",
                               field="bias", path=path)
        r, alpha = raw.get("r"), raw.get("lora_alpha")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise AdapterError(f"must be a positive integer, got {r!r}", field="r", path=path)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise AdapterError(f"must be a number, got {alpha!r}", field="lora_alpha", path=path)
        return cls(r, float(alpha), bool(raw.get("use_rslora", False)), dict(raw.get("rank_pattern") or {}),
                   dict(raw.get("alpha_pattern") or {}), raw.get("target_modules"))

    def rank(self, module: str) -> int:
        return int(self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r))

    def scale(self, module: str) -> float:
        """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with use_rslora."""
        r = self.rank(module)
        alpha = float(self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """peft.utils.other.get_pattern_key: the first pattern matching the module name's end (after a dot)."""
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), module)


def _as_dict(config: Any, path: str | None) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # peft's LoraConfig
        return dict(config.to_dict())
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    raise AdapterError(f"a LoRA config is a dict or a peft LoraConfig, not {type(config).__name__}",
                       field="peft_config", path=path)


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: A [r, in], B [out, r] and PEFT's scale; its weight is served as W + delta()."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self) -> torch.Tensor:
        """scale * B @ A [out, in], in fp32 (whatever the tensors' dtype)."""
        return (self.b.float() @ self.a.float()) * self.scale


@dataclass(frozen=True)
class Adapter:
    """A checked LoRA adapter: its settings and, per adapted module (HF name, e.g.
    `model.layers.0.self_attn.q_proj`), its A, B and scale."""

    settings: LoraSettings
    modules: dict[str, LoraModule]

    @property
    def weight_names(self) -> set[str]:
        """The HF parameters the adapter changes (`<module>.weight`)."""
        return {m + ".weight" for m in self.modules}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.a, m.b))


def plain_name(name: str) -> str:
    """A PEFT model's parameter name as the base model's: no `base_model.model.` prefix, no `.base_layer`."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def split_update(named: NamedTensors) -> tuple[NamedTensors, NamedTensors, set[str]]:
    """(LoRA tensors as named, every other tensor under its base name, the base names of those marked as a base
    under an adapter: `.base_layer.`, as veRL's first sync of a LoRA actor names them). A `lora_` name of a kind
    final does not apply (embedding LoRA, DoRA magnitudes) is refused, naming it."""
    lora, plain, under = [], [], set()
    for name, tensor in named:
        short = name.removeprefix(PEFT_PREFIX)
        if _LORA.match(short):
            lora.append((name, tensor))  # named as sent: errors quote it so
        elif "lora_" in short:
            raise WeightsError("is a LoRA tensor of a kind final does not apply (it applies lora_A / lora_B pairs "
                               "of a decoder layer's projections)", name)
        else:
            plain.append((plain_name(name), tensor))
            if ".base_layer." in short:
                under.add(plain[-1][0])
    return lora, plain, under


def build_adapter(lora: NamedTensors, settings: LoraSettings, shapes: Mapping[str, tuple[int, ...]]) -> Adapter:
    """LoRA tensors (PEFT's names, split_update's first part) -> an Adapter, every tensor checked against the model's
    parameter shapes and the config's ranks; WeightsError naming the first wrong one."""
    check_update(lora, None)  # float, finite, not given twice, not empty
    parts: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in lora:
        m = _LORA.match(name.removeprefix(PEFT_PREFIX))
        module, part = m["module"], m["part"]
        if part in parts.setdefault(module, {}):
            raise WeightsError(f"is given twice (also as {parts[module][part][0]!r})", name)
        weight = module + ".weight"
        if weight not in shapes:
            raise WeightsError(f"adapts {module!r}, which is not a module of this model", name)
        if not module.endswith(PROJECTIONS):
            raise WeightsError(f"adapts {module!r}; final applies LoRA to a layer's projections "
                               f"({', '.join(p.split('.')[-1] for p in PROJECTIONS)})", name)
        parts[module][part] = (name, tensor)
    return Adapter(settings, {module: _module(module, pair, settings, shapes[module + ".weight"])
                              for module, pair in parts.items()})


def _module(module: str, pair: dict[str, tuple[str, torch.Tensor]], settings: LoraSettings,
            shape: tuple[int, ...]) -> LoraModule:
    for have, lack in (("A", "B"), ("B", "A")):
        if lack not in pair:
            raise WeightsError(f"has no lora_{lack} beside it", pair[have][0])
    (a_name, a), (b_name, b) = pair["A"], pair["B"]
    out, inp = shape
    if a.dim() != 2 or a.shape[1] != inp:
        raise WeightsError(f"has shape {list(a.shape)}; lora_A of {module} is [r, {inp}]", a_name)
    if b.dim() != 2 or b.shape[0] != out:
        raise WeightsError(f"has shape {list(b.shape)}; lora_B of {module} is [{out}, r]", b_name)
    if b.shape[1] != a.shape[0]:
        raise WeightsError(f"has rank {b.shape[1]}, its lora_A {a.shape[0]} (shape {list(b.shape)})", b_name)
    if a.shape[0] != settings.rank(module):
        raise WeightsError(f"has rank {a.shape[0]}; the adapter's config gives {module} r={settings.rank(module)}",
                           a_name)
    return LoraModule(a.detach(), b.detach(), settings.scale(module))


def read_adapter(path: str | Path) -> tuple[NamedTensors, LoraSettings]:
    """A PEFT adapter folder (or its adapter_model file, beside its adapter_config.json) -> its tensors and
    settings, read without running pickled code."""
    from safetensors.torch import load_file

    where = Path(path).expanduser()
    folder = where if where.is_dir() else where.parent
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"no {CONFIG_FILE} (a PEFT adapter folder holds it beside adapter_model.safetensors)",
                           path=str(path))
    files = [where] if where.is_file() else [folder / f for f in WEIGHT_FILES if (folder / f).is_file()][:1]
    if not files:
        raise AdapterError(f"holds no {' or '.join(WEIGHT_FILES)}", path=str(path))
    try:
        config = json.loads(config_file.read_text())
        tensors = (load_file(str(files[0])) if files[0].suffix == ".safetensors"
                   else torch.load(str(files[0]), map_location="cpu", weights_only=True))
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: say which one
        raise AdapterError(f"cannot read {files[0].name if config_file.exists() else CONFIG_FILE}: "
                           f"{type(exc).__name__}: {exc}", path=str(path)) from None
    if not isinstance(tensors, Mapping):
        raise AdapterError(f"{files[0].name} does not hold a state dict", path=str(path))
    return list(tensors.items()), LoraSettings.from_config(config, str(path))


def load_adapter_folder(path: str | Path, shapes: Mapping[str, tuple[int, ...]]) -> Adapter:
    """A PEFT adapter folder read and checked against the model's parameter shapes, to serve per request (its
    tensors are LoRA pairs only: nothing else of the model changes)."""
    named, settings = read_adapter(path)
    lora, plain, _ = split_update(named)
    if plain:
        raise WeightsError("is not a LoRA tensor; an adapter served per request holds lora_A / lora_B pairs only",
                           plain[0][0])
    if not lora:
        raise AdapterError("holds no lora_A / lora_B tensors", path=str(path))
    return build_adapter(lora, settings, shapes)


def adapter_name(path: str | Path, name: str | None = None) -> str:
    """The name an adapter is served under: `name`, else its folder's name."""
    if name is None:
        where = Path(path).expanduser()
        name = (where if where.is_dir() else where.parent).resolve().name
    return check_adapter_name(name)


def is_adapter_folder(path: Any) -> bool:
    """A path to a PEFT adapter folder, or to a file in one (what update_weights and load_adapter read)."""
    if not isinstance(path, (str, Path)):
        return False
    where = Path(path).expanduser()
    return (where if where.is_dir() else where.parent).joinpath(CONFIG_FILE).is_file()


def peft_update(weights: Any) -> tuple[NamedTensors, LoraSettings] | None:
    """An update that is a LoRA adapter as a whole: a PEFT adapter folder, or a PeftModel (its active adapter's
    tensors, PEFT's saved names, and its config). None for anything else."""
    if is_adapter_folder(weights):
        return read_adapter(weights)
    config = getattr(weights, "peft_config", None)
    if isinstance(weights, torch.nn.Module) and isinstance(config, Mapping):
        from peft import get_peft_model_state_dict

        name = getattr(weights, "active_adapter", None) or next(iter(config))
        name = name if isinstance(name, str) else name[0]
        return list(get_peft_model_state_dict(weights, adapter_name=name).items()), \
            LoraSettings.from_config(config[name])
    return None


def check_adapter_name(name: Any, field: str = "name") -> str:
    """An adapter's name (what requests and the OpenAI `model` field give): a non-blank string without control
    characters, at most 255 bytes."""
    problem = name_problem(name, 255)
    if problem is not None:
        raise AdapterError(f"{shown(name)} {problem}", field=field)
    return name


def check_adapters(adapters: list[str | None] | None, loaded: Callable[[], list[str]], backend: str, *,
                   tools: bool = False) -> None:
    """A call's adapters are loaded ones (AdapterError naming them and what is loaded); a multi-turn call runs
    on the served weights only (a trainer's adapter is merged into them)."""
    named = sorted({a for a in adapters or [] if a is not None})
    if not named:
        return
    if tools:
        raise UnsupportedError(backend, "adapter", "multi-turn tool calls run on the served weights; serve the "
                               "adapter merged (update_weights) or call without tools")
    known = loaded()
    missing = [a for a in named if a not in known]
    if missing:
        raise AdapterError(f"no adapter named {shown(missing[0])} is loaded (loaded: {sorted(known)})",
                           field="adapter")


def adapters_per_prompt(adapter: Any, n_prompts: int) -> list[str | None] | None:
    """generate(adapter=...): a name for every prompt, or one entry per prompt (a name or None: the base)."""
    if adapter is None:
        return None
    if isinstance(adapter, str):
        return [check_adapter_name(adapter, "adapter")] * n_prompts
    if not isinstance(adapter, (list, tuple)) or len(adapter) != n_prompts:
        raise AdapterError(f"must be a name, or a list of {n_prompts} names or None (one per prompt), got "
                           f"{shown(adapter)}", field="adapter")
    names = [None if a is None else check_adapter_name(a, "adapter") for a in adapter]
    return names if any(a is not None for a in names) else None
