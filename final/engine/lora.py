"""LoRA adapters served per row: rows of different adapters (and rows of none) in one batch, the base weights
multiplied once.

S-LoRA and Punica run the base product for the whole batch, then each row's low-rank delta: a "shrink" x @ A.T into
the rank-r space and an "expand" back with B, segmented by adapter (Punica's SGMV kernels; vLLM's `max_loras`
adapters in a batch, SGLang's `max_loras_per_batch`). On a CPU in torch the same is three ops a matrix whatever the
number of adapters: the adapters of a step are stacked (A's rows end to end, B's columns end to end, each column
owned by one adapter), every row is shrunk by the whole stack, the columns of other adapters are zeroed by a
per-row mask, and one `addmm` expands into the product (`LoraStep.add`). The extra work is a row times the
stack's ranks, next to the base matrix's thousands of columns.

The engine's fused q|k|v and gate|up matrices take one stack each: A is the parts' A end to end ([r_q+r_k+r_v, in])
and B is block-diagonal ([q+k+v out, r_q+r_k+r_v]), PEFT's scale folded in. The delta follows the matrix's product,
after its residual add where the kernel fuses one (the sum is the same: x + W h + B A h), so rows with an adapter
run the per-matrix path (model.forward), and a step with no adapter row keeps the kernel's whole-step decode.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from final.adapters.format import Adapter
from final.errors import AdapterError

KINDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
# adapter combinations whose stacks are kept: the running batch's and those it moved between as rows came and went.
# One adapter's stack is its own tensors (no copy); a combination of several is a copy of them (SmolLM2, 4 adapters of
# r=16 on every projection: 78 MB, made once per new combination)
STACKS = 8
_uids = itertools.count(1)

Pair = tuple[torch.Tensor, torch.Tensor]  # (A [R, in], B [out, R]) of one fused matrix


@dataclass(eq=False)
class EngineAdapter:
    """One loaded adapter in the engine's layout: per layer, per fused matrix, its (A, B) or nothing. `uid` is
    unique per load: a name loaded again is another adapter (what a cache of KV made with it keys on)."""

    name: str
    uid: int
    layers: list[dict[str, Pair]]
    nbytes: int
    dtype: torch.dtype


def lora_sizes(model) -> dict[str, tuple[int, ...]]:
    """Each fused matrix's parts' output rows (q, k, v; gate, up; o; down) of an engine.model.CausalLM."""
    spec = model.spec
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, model.layers[0].w_down.in_features
    return {"qkv": (q, kv, kv), "o": (spec.hidden_size,), "gate_up": (inter, inter), "down": (spec.hidden_size,)}


def to_engine(name: str, adapter: Adapter, sizes: dict[str, tuple[int, ...]], num_layers: int,
              dtype: torch.dtype, device: torch.device) -> EngineAdapter:
    """A checked Adapter -> the fused layout; sizes: each kind's part sizes (out rows), e.g. qkv (q, k, v)."""
    layers: list[dict[str, Pair]] = []
    for i in range(num_layers):
        fused: dict[str, Pair] = {}
        for kind, parts in KINDS.items():
            offsets = [sum(sizes[kind][:j]) for j in range(len(parts))]
            present = [(off, adapter.modules[f"model.layers.{i}.{part}"]) for off, part in zip(offsets, parts)
                       if f"model.layers.{i}.{part}" in adapter.modules]
            if not present:
                continue
            a = torch.cat([m.a.float() for _, m in present])
            b = torch.zeros(sum(sizes[kind]), a.shape[0])
            col = 0
            for off, m in present:
                b[off:off + m.b.shape[0], col:col + m.rank] = m.b.float() * m.scale
                col += m.rank
            fused[kind] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
        layers.append(fused)
    nbytes = sum(t.numel() * t.element_size() for layer in layers for pair in layer.values() for t in pair)
    return EngineAdapter(name, next(_uids), layers, nbytes, dtype)


class Stack:
    """The adapters of a step, stacked per layer and matrix: (A of all, B of all, each column's adapter index)."""

    def __init__(self, adapters: tuple[EngineAdapter, ...]):
        self.adapters, self.dtype = adapters, adapters[0].dtype
        owners: dict[tuple[int, ...], torch.Tensor] = {}  # one owner tensor per column layout, shared by layers
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        for i in range(len(adapters[0].layers)):
            fused = {}
            for kind in KINDS:
                pairs = [(j, a.layers[i][kind]) for j, a in enumerate(adapters) if kind in a.layers[i]]
                if not pairs:
                    continue
                layout = tuple(j for j, (a, _) in pairs for _ in range(a.shape[0]))
                owner = owners.setdefault(layout, torch.tensor(layout, device=pairs[0][1][0].device))
                if len(pairs) == 1:
                    a, b = pairs[0][1]
                else:
                    a, b = torch.cat([p[0] for _, p in pairs]), torch.cat([p[1] for _, p in pairs], dim=1)
                fused[kind] = (a, b, owner)
            self.layers.append(fused)


class LoraStep:
    """One step's rows and their adapters: adds each row's delta to a matrix's product (model.forward)."""

    def __init__(self, stack: Stack, rows: torch.Tensor | None):
        """rows: each row's index into stack.adapters (-1: none); None when every row has the stack's one adapter."""
        self.stack, self.rows = stack, rows
        self._masks: dict[int, torch.Tensor] = {}

    def add(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's (x @ A.T) @ B.T for the `kind` matrix of `layer`; x [B, T, in], y [B, T, out]."""
        entry = self.stack.layers[layer].get(kind)
        if entry is None:
            return y
        a, b, owner = entry
        h = F.linear(x, a)
        if self.rows is not None:
            h = h * self._mask(owner)[:, None, :]
        if y.is_contiguous():
            y.view(-1, y.shape[-1]).addmm_(h.view(-1, h.shape[-1]), b.t())
            return y
        return y + F.linear(h, b)

    def _mask(self, owner: torch.Tensor) -> torch.Tensor:
        mask = self._masks.get(id(owner))
        if mask is None:
            mask = self._masks[id(owner)] = (owner[None, :] == self.rows[:, None]).to(self.stack.dtype)
        return mask


class AdapterTable:
    """The adapters loaded in an engine, by name, and the stacks of recent steps. add/remove run on the engine
    thread (they build or drop tensors); get/names may be called from any thread."""

    def __init__(self, sizes: dict[str, tuple[int, ...]], num_layers: int, dtype: torch.dtype, device: torch.device):
        self.sizes, self.num_layers, self.dtype, self.device = sizes, num_layers, dtype, device
        self._by_name: dict[str, EngineAdapter] = {}
        self._stacks: OrderedDict[tuple[int, ...], Stack] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, name: str, adapter: Adapter) -> EngineAdapter:
        """Load (or replace) an adapter; rows running with the old one of that name finish with it."""
        loaded = to_engine(name, adapter, self.sizes, self.num_layers, self.dtype, self.device)
        with self._lock:
            self._by_name[name] = loaded
        return loaded

    def remove(self, name: str) -> bool:
        with self._lock:
            gone = self._by_name.pop(name, None)
        if gone is not None:  # its stacks go with it (rows still running hold their own step)
            for key in [k for k in self._stacks if gone.uid in k]:
                del self._stacks[key]
        return gone is not None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def get(self, name: str) -> EngineAdapter:
        with self._lock:
            found = self._by_name.get(name)
        if found is None:
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {self.names()})", field="adapter")
        return found

    def step(self, adapters: list[EngineAdapter | None]) -> LoraStep | None:
        """The LoraStep of a batch whose rows have these adapters (None: no delta); None when no row has one."""
        used = tuple(dict.fromkeys(a for a in adapters if a is not None))
        if not used:
            return None
        key = tuple(a.uid for a in used)
        stack = self._stacks.pop(key, None) or Stack(used)
        self._stacks[key] = stack
        while len(self._stacks) > STACKS:
            self._stacks.popitem(last=False)
        if len(used) == 1 and all(a is not None for a in adapters):
            return LoraStep(stack, None)
        index = {a.uid: j for j, a in enumerate(used)}
        rows = torch.tensor([index[a.uid] if a is not None else -1 for a in adapters], device=self.device)
        return LoraStep(stack, rows)
