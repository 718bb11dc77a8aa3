"""Weight updates, checked before anything is written: what `InferenceEngine.update_weights` takes and how it is
validated, whatever backend applies it.

An update is any of
- an `nn.Module` (its state dict: HF parameter names, e.g. a `transformers` model being trained),
- a mapping name -> tensor (a state dict),
- an iterable of `(name, tensor)` pairs: veRL's `update_weights` generator, which an FSDP trainer fills bucket by
  bucket (it is consumed whole before anything is written: atomicity costs holding the update once),
- a path: an HF model folder (its `*.safetensors`, else `pytorch_model*.bin` read with `weights_only=True`) or one
  `.safetensors` file. Nothing pickled is ever executed.

`check_update` refuses, naming the parameter, an unknown name, a wrong shape, a non-float dtype, a NaN or Inf, a
name given twice, or an empty update. A subset of the parameters (one layer) is a valid update. A LoRA adapter
(lora_A / lora_B tensors, a PEFT folder, a PeftModel) is turned into its modules' merged weights first, by
final.adapters.merge, and then checked as any update. The shapes an update is checked against come from the backend (`Backend.parameter_shapes`): the embedded
engine's own layout, or the model's HF parameters on a meta device (`hf_parameter_shapes`).
"""

from __future__ import annotations

import difflib
import functools
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from final.errors import WeightsError

NamedTensors = list[tuple[str, torch.Tensor]]
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def named_tensors(weights: Any) -> NamedTensors:
    """Any accepted update form (not a path) -> a list of (name, tensor), detached."""
    if isinstance(weights, (str, Path)):
        return read_weights(weights)
    if isinstance(weights, torch.nn.Module):
        items: Iterable = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    elif isinstance(weights, Iterable) and not isinstance(weights, (bytes, torch.Tensor)):
        items = weights
    else:
        raise WeightsError(f"an update is an nn.Module, a state dict, (name, tensor) pairs or a path, not "
                           f"{type(weights).__name__}")
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise WeightsError(f"item {i} of the update is not a (name, tensor) pair")
        name, tensor = item
        if not isinstance(name, str):
            raise WeightsError(f"item {i}: a parameter name is a str, not {type(name).__name__}")
        if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2): the whole parameter, as veRL's SGLang sync does
            tensor = tensor.full_tensor()
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"is a {type(tensor).__name__}, not a tensor", name)
        out.append((name, tensor.detach()))
    return out


def read_weights(path: str | Path) -> NamedTensors:
    """The tensors of an HF model folder or a `.safetensors` file, without running pickled code."""
    from safetensors.torch import load_file

    out: NamedTensors = []
    for file in weight_files(path):
        try:
            if file.suffix == ".safetensors":
                tensors = load_file(str(file))
            else:
                tensors = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: say which one
            raise WeightsError(f"cannot read {file.name}: {type(exc).__name__}: {exc}") from None
        if not isinstance(tensors, Mapping):
            raise WeightsError(f"{file.name} does not hold a state dict")
        out.extend(tensors.items())
    return out


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of an HF model folder (its *.safetensors, else pytorch_model*.bin), or the file itself."""
    where = Path(path).expanduser()
    if where.is_file():
        return [where]
    if not where.is_dir():
        raise WeightsError(f"no model folder or weights file at {str(path)!r}")
    files = sorted(where.glob(WEIGHT_FILES[0])) or sorted(where.glob(WEIGHT_FILES[1]))
    if not files:
        raise WeightsError(f"{str(path)!r} holds no *.safetensors or pytorch_model*.bin")
    return files


def check_update(named: NamedTensors, shapes: Mapping[str, tuple[int, ...]] | None) -> NamedTensors:
    """Refuse a bad update before anything is written (see the module doc). shapes None: names and shapes are
    checked where the weights go (a remote server); dtype, finiteness and duplicates are checked here."""
    if not named:
        raise WeightsError("the update holds no tensors")
    seen: set[str] = set()
    for name, tensor in named:
        if name in seen:
            raise WeightsError("is given twice in one update", name)
        seen.add(name)
        if shapes is not None:
            if name not in shapes:
                close = difflib.get_close_matches(name, list(shapes), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise WeightsError(f"is not a parameter of this model{hint}", name)
            if tuple(tensor.shape) != tuple(shapes[name]):
                raise WeightsError(f"has shape {list(tensor.shape)}, the model's is {list(shapes[name])}", name)
        if not tensor.is_floating_point():
            raise WeightsError(f"has dtype {tensor.dtype}; weights are floating point", name)
        if not finite(tensor):
            raise WeightsError("holds NaN or Inf values", name)
    return named


def finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf in tensor: one sum in its own dtype (NaN and Inf propagate into it; 3x faster than a float64
    sum or isfinite().all(), which a full update would pay on every parameter), and the exact elementwise check
    only when the sum is not finite (NaN/Inf, or finite values summing past the dtype's range)."""
    if tensor.numel() == 0:
        return True
    if math.isfinite(float(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


@functools.lru_cache(maxsize=8)
def hf_parameter_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape of the model's HF checkpoint (its state dict, tied names included), from
    its config.json on a meta device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()
              if not name.endswith(("rotary_emb.inv_freq", "original_inv_freq"))}
    if getattr(cfg, "tie_word_embeddings", False):
        shapes.setdefault("lm_head.weight", shapes.get("model.embed_tokens.weight"))
    return shapes


def save_weights(named: NamedTensors, file: str | Path) -> Path:
    """Write an update as one `.safetensors` file (what a remote server reads back with read_weights)."""
    from safetensors.torch import save_file

    file = Path(file)
    tensors, seen = {}, set()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:  # a tied weight: safetensors stores no shared memory
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, str(file))
    return file
