"""A trainer's LoRA adapter, merged into the weights an engine serves: what a backend's `update_weights` does with
adapter tensors.

veRL's LoRA actor syncs its rollout in two phases (`fsdp_workers.rollout_mode`): while `base_sync_done` is False
it sends the base model (targeted modules renamed `<module>.base_layer.weight`, with its `peft_config`), after that
only the adapter (`get_peft_model_state_dict`: `base_model.model.<module>.lora_A.weight`, ...). vLLM keeps the
adapter apart (`add_lora`); here it is merged: each adapted module's served weight is its kept base plus
scale * B @ A, recomputed from that base on every adapter update (never merged twice), so the engine's fast paths
run unchanged. The rules:
- an update holding LoRA tensors replaces the adapter (its config: the trainer's peft_config, a PEFT folder's
  adapter_config.json, a PeftModel's own); its other tensors are the base under it;
- a base sync (`.base_layer.` names, or veRL's `base_sync_done=False` with a peft_config) replaces the base of the
  modules it names; the adapter stays applied on top;
- any other update is the weights to serve: the adapter is dropped first (every merged module back to its base),
  so a full update after adapters serves exactly its own tensors.
A module's base is read once, before its first merge (`BaseReader`), and kept while an adapter changes it. Every
update is computed whole before anything is written, and the kept state changes only once the backend has taken
it (`Plan.commit`): a refused update leaves weights, adapter and bases as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from final.adapters.format import Adapter, LoraSettings, build_adapter, peft_update, split_update
from final.errors import WeightsError
from final.weights import NamedTensors, named_tensors, weight_files


Shapes = Mapping[str, tuple[int, ...]]


class BaseReader(Protocol):
    """Where a module's base weight comes from the first time an adapter changes it."""

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The current (unmerged) weights of these HF parameters."""

    def written(self, names: set[str], bases: NamedTensors = ()) -> None:
        """These parameters were just written (a remote engine's model folder no longer holds them); `bases`, of
        them, are a base an adapter will be merged into (veRL's `.base_layer.` sync)."""


@dataclass
class Plan:
    """An update made ready: `named` is what the backend writes (plain HF names, served values); `commit()` once
    it has been written."""

    named: NamedTensors
    commit: Callable[[], None]


class MergedAdapter:
    """The adapter a trainer syncs, merged into one backend's weights (the rules: this module's docstring)."""

    def __init__(self, reader: BaseReader):
        self.reader = reader
        self.adapter: Adapter | None = None
        self.bases: dict[str, torch.Tensor] = {}  # the base of every parameter the adapter changes

    def plan(self, weights: Any, shapes: Shapes | Callable[[], Shapes], *, peft_config: Any = None,
             base_sync_done: bool | None = None) -> Plan:
        """Any update form (final.weights, a PEFT folder, a PeftModel; veRL's keywords) -> the Plan to write.
        shapes: the model's parameter shapes, or a function giving them (called only when an adapter is in play)."""
        whole = peft_update(weights)
        named, settings = whole if whole is not None else (named_tensors(weights), None)
        lora, plain, under = split_update(named)
        if lora:
            if settings is None and peft_config is None:
                raise WeightsError("is a LoRA tensor, and the update carries no LoRA config: pass peft_config "
                                   "(r, lora_alpha, ...) or a PEFT adapter folder", lora[0][0])
            settings = settings or LoraSettings.from_config(peft_config)
            shapes = shapes() if callable(shapes) else shapes
            return self._merge(build_adapter(lora, settings, shapes), plain, shapes)
        if self.adapter is not None and (under or (base_sync_done is False and peft_config is not None)):
            return self._merge(self.adapter, plain, shapes() if callable(shapes) else shapes)
        if self.adapter is None:  # nothing merged: the update as given (a base for adapters to come is kept)
            bases = [(n, t) for n, t in plain if n in under]
            return Plan(plain, lambda: self.reader.written({n for n, _ in plain}, bases))
        return self._drop(plain)

    def _merge(self, adapter: Adapter, base: NamedTensors, shapes: Shapes) -> Plan:
        """Serve `adapter` over the kept bases, with `base` (plain names) as the new base of what it names."""
        targets = adapter.weight_names
        given = dict(base)
        for name in sorted(set(given) & targets):  # a base under the adapter: checked here, as the write would
            if tuple(given[name].shape) != tuple(shapes.get(name, ())):
                raise WeightsError(f"has shape {list(given[name].shape)}, the model's is "
                                   f"{list(shapes.get(name, ()))}", name)
        bases = {n: given.get(n, t) for n, t in self.bases.items()}
        bases.update({n: given[n] for n in targets & set(given)})
        missing = sorted(targets - set(bases))
        bases.update(self.reader.read(missing) if missing else {})
        out = [(n, t) for n, t in base if n not in targets and n not in self.bases]
        for name in sorted(targets):
            module = adapter.modules[name.removesuffix(".weight")]
            out.append((name, (bases[name].float() + module.delta()).to(bases[name].dtype)))
        restored = [(n, bases[n]) for n in sorted(set(self.bases) - targets)]  # no longer adapted: back to base
        out += restored
        keep = {n: bases[n].detach().clone() if n in given else bases[n] for n in targets}

        def commit() -> None:
            self.adapter, self.bases = adapter, keep
            self.reader.written({n for n, _ in out}, restored)

        return Plan(out, commit)

    def _drop(self, plain: NamedTensors) -> Plan:
        """A plain update while an adapter is merged: every merged module back to its base, then the update."""
        given = {n for n, _ in plain}
        restored = [(n, t) for n, t in self.bases.items() if n not in given]
        out = restored + list(plain)

        def commit() -> None:
            self.adapter, self.bases = None, {}
            self.reader.written({n for n, _ in out}, restored)

        return Plan(out, commit)


def lora_keywords(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """veRL's update_weights keywords that MergedAdapter.plan reads."""
    return {"peft_config": kwargs.get("peft_config"), "base_sync_done": kwargs.get("base_sync_done")}


class LiveBase:
    """A BaseReader for an engine in this process: a base is what the engine serves before the first merge."""

    def __init__(self, current: Callable[[list[str]], dict[str, torch.Tensor]]):
        self.current = current

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self.current(names)

    def written(self, names: set[str], bases: NamedTensors = ()) -> None:
        """Nothing to track: the engine is read again next time."""


class FolderBase:
    """A BaseReader for an engine in another process or machine (SGLang's scheduler, a Tokasaurus server): a base
    comes from the model folder the engine loaded, and a parameter written since by an update it cannot know is
    refused (send the base again: `.base_layer.` names, or veRL's base sync)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.dirty: set[str] = set()  # written since load, values unknown here
        self.kept: dict[str, torch.Tensor] = {}  # written since load as a base under an adapter

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {n: self.kept[n] for n in names if n in self.kept}
        names = [n for n in names if n not in out]
        stale = [n for n in names if n in self.dirty]
        if stale:
            raise WeightsError("was changed by an earlier update whose values this backend did not keep, so the "
                               "adapter has no base to merge into: send the base with the adapter (veRL's base "
                               "sync, or `<module>.base_layer.weight` names)", stale[0])
        for file in weight_files(self.model_dir) if names else []:
            if file.suffix != ".safetensors":
                raise WeightsError(f"{file.name}: the base of an adapter is read from *.safetensors files only")
            with safe_open(str(file), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in names if n in f.keys()})
        lost = [n for n in names if n not in out]
        if lost:
            raise WeightsError(f"is not in the model folder's weights ({self.model_dir})", lost[0])
        return out

    def written(self, names: set[str], bases: NamedTensors = ()) -> None:
        self.kept = {n: t for n, t in self.kept.items() if n not in names}
        self.kept.update((n, t.detach().clone()) for n, t in bases)
        self.dirty |= names - set(self.kept)
