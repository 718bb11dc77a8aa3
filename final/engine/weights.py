"""HF-named parameters -> the embedded engine's own layout (fused q|k|v and gate|up, the C kernel's arena, int8
blocks, bf16 halves): which names and shapes it holds, and how an update is written into them.

Every write lands in the tensors the engine already holds (the kernel's address tables and the weight arena stay
valid); an int8 matrix is dequantized, overwritten and quantized again once per update, however many of its HF
parts the update names. Callers check the update first (final.weights.check_update against parameter_shapes):
the write itself then cannot fail half-way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from final.errors import WeightsError

if TYPE_CHECKING:
    from final.engine.model import CausalLM

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_NORMS = {"input_layernorm": "in_norm", "post_attention_layernorm": "post_norm", "self_attn.q_norm": "q_norm",
          "self_attn.k_norm": "k_norm"}


def parameter_shapes(model: "CausalLM") -> dict[str, tuple[int, ...]]:
    """Every HF parameter name this engine holds, with its shape (what an update may name)."""
    spec = model.spec
    hidden, D = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_heads * D, spec.num_kv_heads * D
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": tuple(model.embed.shape),
                                          "model.norm.weight": (hidden,),
                                          "lm_head.weight": (model.lm_head.out_features, model.lm_head.in_features)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        inter = layer.w_down.in_features
        for module, out in zip(_QKV, (q_out, kv_out, kv_out)):
            shapes[p + module + ".weight"] = (out, hidden)
            if layer.wqkv.bias is not None:
                shapes[p + module + ".bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        for module, matrix, out in (("self_attn.o_proj", layer.wo, hidden), ("mlp.gate_proj", layer.w_gate_up, inter),
                                    ("mlp.up_proj", layer.w_gate_up, inter), ("mlp.down_proj", layer.w_down, hidden)):
            if matrix.bias is not None:
                shapes[p + module + ".bias"] = (out,)
        for hf, ours in _NORMS.items():
            if getattr(layer, ours) is not None:
                shapes[p + hf + ".weight"] = tuple(getattr(layer, ours).shape)
    return shapes


def load_weights(model: "CausalLM", named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write HF-named tensors into the engine's layout. Run on the engine thread, after the update was checked (an
    unknown name still raises WeightsError, before anything is written)."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, value)
    rows: dict[int, tuple[object, list]] = {}  # id(matrix) -> (matrix, its (lo, hi, value) blocks)
    for name, tensor in named:
        value = tensor.detach().to(device=model.device, dtype=model.dtype)
        for target in _targets(model, name):
            if isinstance(target, torch.Tensor):
                copies.append((target, value))
            else:
                matrix, lo, hi = target
                rows.setdefault(id(matrix), (matrix, []))[1].append((lo, hi, value))
    for dest, value in copies:
        dest.copy_(value)
    for matrix, blocks in rows.values():
        matrix.set_row_blocks(blocks)


def current_weights(model: "CausalLM", names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The HF-named parameters as the engine serves them now (copies, in the model dtype; int8 dequantized): the
    base an adapter is merged into (final.adapters.merge). Run on the engine thread."""
    out = {}
    for name in names:
        target = _targets(model, name)[0]
        if isinstance(target, torch.Tensor):
            out[name] = target.detach().clone()
        else:
            matrix, lo, hi = target
            out[name] = matrix.dense()[lo:hi].clone()
    return out


def _targets(model: "CausalLM", name: str) -> list:
    """Where one HF parameter goes: tensors to copy into, or (matrix, first row, end row) blocks."""
    spec = model.spec
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        out: list = []
        if name.startswith("model.") or model.tied:
            out.append(model.embed)
        if (name == "lm_head.weight" or model.tied) and model.lm_head.weight is not model.embed:
            out.append((model.lm_head, 0, model.lm_head.out_features))
        return out
    if name == "model.norm.weight":
        return [model.norm]
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() \
            or int(parts[2]) >= len(model.layers):
        raise WeightsError("is not a parameter of this model", name)
    layer = model.layers[int(parts[2])]
    module, kind = ".".join(parts[3:]).rsplit(".", 1)
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if module in _QKV:
        lo = (0, q_out, q_out + kv_out)[_QKV.index(module)]
        hi = lo + (q_out if module == _QKV[0] else kv_out)
        if kind == "weight":
            return [(layer.wqkv, lo, hi)]
        if kind == "bias" and layer.wqkv.bias is not None:
            return [layer.wqkv.bias[lo:hi]]
    elif module in ("mlp.gate_proj", "mlp.up_proj"):
        inter = layer.w_down.in_features
        lo = 0 if module == "mlp.gate_proj" else inter
        if kind == "weight":
            return [(layer.w_gate_up, lo, lo + inter)]
        if kind == "bias" and layer.w_gate_up.bias is not None:
            return [layer.w_gate_up.bias[lo:lo + inter]]
    elif module in ("self_attn.o_proj", "mlp.down_proj"):
        matrix = layer.wo if module == "self_attn.o_proj" else layer.w_down
        if kind == "weight":
            return [(matrix, 0, matrix.out_features)]
        if kind == "bias" and matrix.bias is not None:
            return [matrix.bias]
    elif module in _NORMS and kind == "weight" and getattr(layer, _NORMS[module]) is not None:
        return [getattr(layer, _NORMS[module])]
    raise WeightsError("is not a parameter of this model", name)
