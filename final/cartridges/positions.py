"""Which positions a cartridge was trained to be followed at, and the key rotation that serves either exactly.

The HazyResearch cartridges repo changed its convention. Its June 2025 code trains through HF with the cache in
`past_key_values`, so HF takes the positions of the tokens after the cartridge from the cache length: they start
at p, the cartridge's token count (`after_prefix`: what Tokasaurus' geoff/cartridges branch and final serve). Its
later code packs sequences for FlexAttention and gives each one `position_ids = arange(len)` (datasets.py's
collate, the same in flex_generate): the tokens after the cartridge start at 0 (`from_zero`).

Every engine here serves `after_prefix`. A `from_zero` cartridge is served exactly anyway: its keys are post-RoPE,
so a query at position m scores a stored key k as (R_m q)·k. Served at m + p instead, the query becomes R_{m+p} q,
and rotating every stored key by R_p gives (R_{m+p} q)·(R_p k) = (R_m q)·k: the same scores, on every backend,
without touching the engine. The rotation uses the model's own inv_freq (rope scaling included) and no attention
scaling factor (the stored keys already carry it), in the rotate_half layout of HF's Llama/Qwen/Mistral.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from final.compat import rope_init_functions
from final.cartridges.format import CartridgeKV
from final.errors import CartridgeError

AFTER_PREFIX = "after_prefix"
FROM_ZERO = "from_zero"
POSITIONS = (AFTER_PREFIX, FROM_ZERO)
DEFAULT_POSITIONS = AFTER_PREFIX
# HF model types whose attention applies RoPE as `x * cos + rotate_half(x) * sin` over the whole head.
ROTATE_HALF_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"})


def check_positions(value: Any, *, file: str | None = None, field: str = "positions") -> str:
    if value not in POSITIONS:
        raise CartridgeError(f"must be one of {', '.join(POSITIONS)}, got {value!r}", file=file, field=field)
    return value


def to_after_prefix(cart: CartridgeKV, positions: str, model_dir: str | Path | None, name: str) -> CartridgeKV:
    """The cartridge as the engines serve it (tokens after it at p): `from_zero` keys rotated by R_p."""
    if check_positions(positions, file=name) == AFTER_PREFIX:
        return cart
    if model_dir is None:
        raise CartridgeError("converting a from_zero cartridge needs the model's folder (its RoPE settings)",
                             file=name, field="positions")
    return moved(cart, cart.num_tokens, model_dir, name)


def moved(cart: CartridgeKV, by: int, model_dir: str | Path, name: str) -> CartridgeKV:
    """The cartridge with every stored key rotated by R_by: as if each of its tokens sat `by` positions later."""
    cos, sin = rotation(model_dir, by, cart.head_dim, name)
    return CartridgeKV([rotate(k, cos, sin) for k in cart.keys], cart.values, cart.num_frozen_tokens)


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys [..., head_dim] moved by the rotation (cos, sin): float32, then back to k's dtype (one
    rounding, as a stored key has)."""
    x, half = k.float(), k.shape[-1] // 2
    return (x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin).to(k.dtype).contiguous()


def rotation(model_dir: str | Path, p: int, head_dim: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of R_p, [head_dim], from the model's config (HF's own rope init: default, linear, llama3, yarn...).
    p may be negative (a key moved to an earlier position)."""
    from transformers import AutoConfig

    ROPE_INIT_FUNCTIONS = rope_init_functions()  # noqa: N806 - HF's table, under HF's name
    config = AutoConfig.from_pretrained(str(model_dir))
    config = getattr(config, "text_config", None) or config
    if config.model_type not in ROTATE_HALF_MODELS:
        raise CartridgeError(f"cannot convert positions for model type {config.model_type!r} (known rotate_half "
                             f"RoPE: {', '.join(sorted(ROTATE_HALF_MODELS))}); serve it with positions=after_prefix",
                             file=name, field="positions")
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):  # these depend on the length
        raise CartridgeError(f"cannot convert positions under rope scaling {rope_type!r}", file=name,
                             field="positions")
    inv_freq, _attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    if 2 * inv_freq.numel() != head_dim:
        raise CartridgeError(f"the model rotates {2 * inv_freq.numel()} of {head_dim} head dims; only full-head "
                             "RoPE is converted", file=name, field="positions")
    angle = p * inv_freq.double()  # p * inv_freq as HF's float32 table holds it would lose digits for large p
    emb = torch.cat((angle, angle))
    return emb.cos().float(), emb.sin().float()


# ---- the cartridges repo's run config (config.yaml saved with the run, beside the cartridge) ------------------
def detect_positions(config_file: str | Path | None) -> str | None:
    """The convention a cartridges-repo run config says it trained with, or None when it does not say.

    An explicit `positions:` key wins. Otherwise the dataset section tells the code version: the later code's
    packed datasets (`packed_seq_length` / `packing_mode`, positions arange(len) per sequence) mean from_zero;
    the June code's `max_sequence_length` / `label_type` (HF past_key_values) mean after_prefix. W&B's
    config.yaml wraps each top-level key as {desc, value}: both shapes are read.
    """
    if config_file is None or not Path(config_file).is_file():
        return None
    data = _read_yaml(Path(config_file))
    explicit = _value(data.get("positions"))
    if explicit is not None:
        return check_positions(explicit, file=str(config_file), field="config.yaml positions")
    dataset = _value(data.get("dataset"))
    if not isinstance(dataset, dict):
        return None
    if "packed_seq_length" in dataset or "packing_mode" in dataset:
        return FROM_ZERO
    if "label_type" in dataset or "max_sequence_length" in dataset:
        return AFTER_PREFIX
    return None


def _value(item: Any) -> Any:
    return item["value"] if isinstance(item, dict) and set(item) <= {"desc", "value"} and "value" in item else item


def _read_yaml(path: Path) -> dict:
    """safe_load only (never a Python-object tag); the repo's configs may hold `!!python/tuple` tags, which
    Tokasaurus rewrites with yaml's FullLoader: here they are read as plain sequences instead."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else
        loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node)))
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CartridgeError(f"unreadable run config: {str(exc)[:200]}", file=str(path), field="config.yaml") from None
    return data if isinstance(data, dict) else {}


def run_config_beside(file: str | Path) -> Path | None:
    """The run's config.yaml in the cartridge file's folder (the cartridges repo, W&B and Tokasaurus layouts)."""
    path = Path(file).parent / "config.yaml"
    return path if path.is_file() else None

