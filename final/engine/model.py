"""A Llama-family decoder in plain PyTorch (Llama, Mistral, Qwen2, Qwen3), loaded from a HF folder.

Weights come from transformers' own loader (so sharding, tying and dtype handling are HF's), then move into
fused q|k|v and gate|up matrices. Attention is delegated to an `AttentionPlan` (final/engine/attention.py)
that owns the KV cache writes and any cartridge prefix, so this file is only the math of one forward pass.
Numerics follow HF exactly (RMSNorm in fp32, RoPE tables from HF's own inv_freq and attention scaling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from final.config import LOCAL_QUANTIZATIONS
from final.engine.arena import WeightArena
from final.engine.kernels import Q8_BLOCK, Q8_ROWS, abi, address, gemv_kernel, unavailable
from final.engine.kv_cache import KVCache
from final.engine.linear import Bf16Linear, Int8Linear, Linear, gemv_enabled, packing_enabled
from final.engine.weights import load_weights, parameter_shapes
from final.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from final.engine.attention import DecodePlan
    from final.engine.lora import LoraStep

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qk_norm: bool

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token across layers, per byte of dtype (multiply by element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelSpec":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED:
            raise ModelError(
                f"the embedded engine supports model types {sorted(SUPPORTED)}, got {model_type!r}; "
                "use rollout.name: sglang on a CUDA machine for other architectures"
            )
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", model_type == "mistral"):
            raise ModelError(f"sliding-window attention ({model_type}) is not supported by the embedded engine")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            qk_norm=model_type == "qwen3",
        )


class AttentionPlan(Protocol):
    """What a forward pass needs from the cache side: write this layer's K/V, return attention output."""

    fuses_layers: bool  # the kernel may run whole decode layers on this plan's cache, lengths, scale, prefixes
    cache: KVCache
    lengths: torch.Tensor
    scale: float
    prefixes: tuple[torch.Tensor, torch.Tensor] | None  # the rows' cartridges as the kernel reads them (DecodePlan)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B,T,H,D], k/v [B,T,Hkv,D] (post-RoPE) -> [B,T,H,D]."""
        ...


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """A typed error naming the config key for a quantization this model, device or CPU cannot run (int8: the
    engine's kernel must run here; int8_shapes checks the model's matrices once it is read)."""
    key = "rollout.engine_kwargs.local.quantization"
    if quantization is None:
        return
    if quantization not in LOCAL_QUANTIZATIONS:
        raise ConfigError(f"must be one of {list(LOCAL_QUANTIZATIONS)} or null, got {quantization!r}", key=key)
    if device.type != "cpu" or dtype != torch.float32:
        raise ConfigError(f"{quantization} runs on CPU with dtype float32 (auto), not {device.type} {dtype}", key=key)
    if quantization == "int8" and gemv_kernel() is None:
        raise ConfigError(f"int8 runs on the engine's C kernel only, which cannot run here: {unavailable()} "
                          "(use quantization: bf16 or null)", key=key)


def int8_shapes(hf, quantization: str | None) -> None:
    """For int8, a ConfigError naming the first matrix it cannot hold: the kernel's blocks need rows of 32s
    (in_features) and groups of 16 rows (out_features)."""
    int8 = quantization == "int8"
    linears = [(n, m) for n, m in hf.named_modules() if int8 and isinstance(m, torch.nn.Linear)]
    for name, module in linears:
        if module.in_features % Q8_BLOCK or module.out_features % Q8_ROWS:
            raise ConfigError(f"int8 needs every matrix's in_features a multiple of {Q8_BLOCK} and out_features of "
                              f"{Q8_ROWS}; {name} is [{module.out_features}, {module.in_features}]",
                              key="rollout.engine_kwargs.local.quantization")


def _arena_for(hf, tied: bool, quantization: str | None) -> WeightArena:
    """An arena holding every matrix a model's products read (the tied embedding is its lm_head): fp32, bf16, or
    int8 with its fp32 scale per Q8_BLOCK weights. Sized by the HF projections one by one: a fused q|k|v or gate|up
    needs no more than its parts' rounded sizes."""
    head = hf.model.embed_tokens.weight if tied else hf.lm_head.weight
    mats = [head] + [p.weight for layer in hf.model.layers
                     for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                               layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if quantization == "int8":
        return WeightArena(WeightArena.size([n for w in mats for n in (w.numel(), w.numel() // Q8_BLOCK * 4)]))
    return WeightArena(WeightArena.size([w.numel() * (2 if quantization == "bf16" else 4) for w in mats]))


def _check_held(model: "CausalLM", hf, path: str) -> None:
    """ModelError naming the HF parameters the engine's layout has no place for (a bias or norm of an architecture
    variant this loader does not know would otherwise be dropped silently)."""
    held = parameter_shapes(model)
    dropped = [name for name, _ in hf.named_parameters() if name not in held]
    if dropped:
        raise ModelError(f"the embedded engine does not hold {', '.join(dropped[:4])}"
                         f"{f' (and {len(dropped) - 4} more)' if len(dropped) > 4 else ''} of {path}")


def _rope_tables(rotary, positions: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D] from HF's own inv_freq and attention scaling, so every rope type (default, llama3,
    yarn...) matches."""
    inv_freq = rotary.inv_freq.float().cpu()
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return (emb.cos() * scale).to(dtype).to(device), (emb.sin() * scale).to(dtype).to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # one op instead of six (x 61 norms a decode step): bitwise HF's in fp32 (tests/test_engine_int8.py)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # HF: normalise in fp32, cast back, then scale (the order matters for bf16 parity).
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` in 4 ops instead of 6, bitwise the same.

    rotate_half(x) = cat(-x2, x1) = roll(x, D/2) with the first half negated, and -a*b == a*(-b) exactly,
    so the sign lives in the table: sin_signed = cat(-sin[:D/2], sin[D/2:]).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


Matrix = Linear | Int8Linear | Bf16Linear  # a weight matrix, fp32 (or the model dtype), int8 or bf16


def _biases(*projections: torch.nn.Linear) -> torch.Tensor | None:
    """The fused matrix's bias: its parts' biases end to end (zeros for a part without one), or None if none has
    one (HF: attention_bias gives q, k, v and o theirs, Qwen2 q, k and v, mlp_bias gate, up and down)."""
    if all(p.bias is None for p in projections):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=p.weight.dtype)
                      for p in projections]).detach().contiguous()


@dataclass
class Layer:
    wqkv: Matrix  # q|k|v fused (with qkv bias where the model has one)
    wo: Matrix
    w_gate_up: Matrix  # gate|up fused
    w_down: Matrix
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class CausalLM:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, lm_head: Matrix, norm: torch.Tensor,
                 layers: list[Layer], cos: torch.Tensor, sin: torch.Tensor, tied: bool = False):
        self.spec = spec
        self.embed, self.lm_head, self.norm = embed, lm_head, norm
        self.tied = tied  # lm_head is the embedding matrix (a packed lm_head is then a second copy of it)
        self.layers = layers
        self.cos, self.sin = cos, sin
        half = sin.shape[-1] // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.dtype = embed.dtype
        self.device = embed.device
        mats = [lm_head] + [m for layer in layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        # the gemv kernel, where every product here runs on it (int8 needs rows of 32s); None: torch's kernels
        self.kernel = lm_head.gemv if all(m.gemv is not None for m in mats) else None
        self._kind = lm_head._gemv_weight().dtype if self.kernel is not None else None  # fp32, bf16 or int8: all
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # _kernel_tables' (layers, head)
        self._buffers: tuple[int, torch.Tensor, torch.Tensor] | None = None  # _step_buffers' (rows, x, work)

    @property
    def nbytes(self) -> int:
        tensors = [self.embed, self.norm]
        linears = [self.lm_head] if self.lm_head.weight is None or self.lm_head.weight is not self.embed else []
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
            linears += [t for t in vars(layer).values() if isinstance(t, (Linear, Int8Linear, Bf16Linear))]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(lin.nbytes for lin in linears)

    # ---- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: str | torch.device = "cpu",
                        quantization: str | None = None) -> "CausalLM":
        """quantization "int8" or "bf16": every weight matrix (lm_head too; the embedding lookup stays fp32) as
        Int8Linear or Bf16Linear (weight-only: activations fp32)."""
        from transformers import AutoModelForCausalLM

        device = torch.device(device)
        check_quantization(quantization, device, dtype)
        with torch.device("cpu"):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
        spec = ModelSpec.from_hf_config(hf.config)
        int8_shapes(hf, quantization)

        def t(x: torch.Tensor) -> torch.Tensor:
            return x.detach().to(device).contiguous()

        pack = packing_enabled(device, dtype)
        # fp32 on CPU (which int8 and bf16 need too): the kernel takes all three; int8 with or without oneDNN
        gemv = gemv_kernel() if quantization == "int8" else gemv_enabled(device, dtype)
        base = hf.model
        tied = hf.lm_head.weight.data_ptr() == base.embed_tokens.weight.data_ptr()
        # the fp32, bf16 or int8 weights the kernel streams, in one buffer on huge pages (final/engine/arena.py)
        bf16 = quantization == "bf16"
        arena = _arena_for(hf, tied, quantization) if gemv is not None else None

        def dense(w: torch.Tensor) -> torch.Tensor:
            return arena.take(w.detach()) if arena is not None else t(w)

        def lin(w: torch.Tensor, b: torch.Tensor | None = None) -> Matrix:
            b = t(b) if b is not None else None
            if quantization == "int8":
                return Int8Linear(t(w), b, gemv=gemv, arena=arena)
            if bf16:
                return Bf16Linear(dense(w.detach().to(torch.bfloat16)), b, gemv=gemv)
            return Linear(dense(w), b, pack=pack, gemv=gemv)

        embed = dense(base.embed_tokens.weight) if tied and not quantization else t(base.embed_tokens.weight)
        # tied and int8/bf16: the lm_head is an int8/bf16 copy of the embedding, which stays fp32 for the lookup
        lm_head = (Linear(embed, pack=pack, gemv=gemv) if tied and not quantization
                   else lin(embed if tied else hf.lm_head.weight))
        layers = []
        for theirs in base.layers:
            att, mlp = theirs.self_attn, theirs.mlp
            layers.append(Layer(
                wqkv=lin(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                         _biases(att.q_proj, att.k_proj, att.v_proj)),
                wo=lin(att.o_proj.weight, att.o_proj.bias),
                w_gate_up=lin(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                              _biases(mlp.gate_proj, mlp.up_proj)),
                w_down=lin(mlp.down_proj.weight, mlp.down_proj.bias),
                in_norm=t(theirs.input_layernorm.weight),
                post_norm=t(theirs.post_attention_layernorm.weight),
                q_norm=t(att.q_norm.weight) if spec.qk_norm else None,
                k_norm=t(att.k_norm.weight) if spec.qk_norm else None,
            ))
        cos, sin = _rope_tables(base.rotary_emb, spec.max_position_embeddings, dtype, device)
        model = cls(spec, embed, lm_head, t(base.norm.weight), layers, cos, sin, tied=tied)
        _check_held(model, hf, path)
        return model

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                final_norm: bool = True, lora: LoraStep | None = None) -> torch.Tensor:
        """ids, positions [B,T] -> final-norm hidden states [B,T,hidden] (before the final norm with final_norm=False,
        for `logits(normed=False)`). lora: the rows' adapters, whose deltas follow each product (engine/lora.py)."""
        spec = self.spec
        B, T = ids.shape
        H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        x = F.embedding(ids, self.embed)
        cos = self.cos[positions].unsqueeze(2)  # [B,T,1,D]
        sin = self.sin_signed[positions].unsqueeze(2)
        # a decode step's few rows: norm + product, SwiGLU + product + residual as single gemv kernel calls
        fused = self.kernel is not None and self.layers[0].wqkv.fuses(B * T) and lora is None
        for i, layer in enumerate(self.layers):
            if fused:
                qkv = layer.wqkv.normed(x, layer.in_norm, spec.rms_norm_eps)
            else:
                h = rms_norm(x, layer.in_norm, spec.rms_norm_eps)
                qkv = layer.wqkv(h) if lora is None else lora.add(i, "qkv", h, layer.wqkv(h))
            v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D)
            if layer.q_norm is None:  # q and k are adjacent in qkv: rotate them as one tensor
                qk = rope(qkv[..., : (H + Hkv) * D].view(B, T, H + Hkv, D), cos, sin)
                q, k = qk[:, :, :H], qk[:, :, H:]
            else:
                q = rms_norm(qkv[..., : H * D].view(B, T, H, D), layer.q_norm, spec.rms_norm_eps)
                k = rms_norm(qkv[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D), layer.k_norm, spec.rms_norm_eps)
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            o = plan.attend(i, q, k, v).reshape(B, T, -1)
            x = layer.wo.add_to(x, o) if lora is None else lora.add(i, "o", o, layer.wo.add_to(x, o))
            if fused:
                x = layer.w_down.glu_add_to(x, layer.w_gate_up.normed(x, layer.post_norm, spec.rms_norm_eps))
                continue
            h = rms_norm(x, layer.post_norm, spec.rms_norm_eps)
            gate, up = (layer.w_gate_up(h) if lora is None else lora.add(i, "gate_up", h, layer.w_gate_up(h))
                        ).chunk(2, dim=-1)
            h = F.silu(gate) * up
            x = layer.w_down.add_to(x, h) if lora is None else lora.add(i, "down", h, layer.w_down.add_to(x, h))
        return rms_norm(x, self.norm, spec.rms_norm_eps) if final_norm else x

    def decode(self, plan: DecodePlan, lora: LoraStep | None = None) -> torch.Tensor:
        """One new token per row (plan.step: token ids, positions, cached lengths) -> logits [B, V] in the model
        dtype. Where the kernel runs the whole step (fp32 cache on CPU, no qk-norm, rows it takes, no adapter), one
        call from embedding to logits (gemv.c final_decode_step) and one torch op (the logits); else forward +
        logits."""
        B = plan.batch
        if (self.kernel is not None and plan.fuses_layers and not self.spec.qk_norm and self.lm_head.fuses(B)
                and self.lm_head.bias is None and lora is None):
            logits = torch.empty(B, self.lm_head.out_features)
            cache, spec = plan.cache, self.spec
            layer_table, head_table = self._kernel_tables()
            self.kernel.decode_step(plan.step, self.embed, self.cos, self.sin_signed, self._kind, layer_table,
                                    cache.addresses(), (cache.num_kv_heads, cache.tokens, cache.head_dim),
                                    spec.num_heads, self.layers[0].w_down.in_features, plan.scale,
                                    spec.rms_norm_eps, head_table, logits, self._step_buffers(B), plan.prefixes)
            return logits
        rows = plan.rows
        hidden = self.forward(rows[0, :, None], rows[1, :, None], plan, final_norm=False, lora=lora)
        return self.logits(hidden[:, 0], upcast=False, normed=False)

    def _step_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's decode-step buffers for `rows` rows (the residual stream and its work area), kept between
        steps: two torch ops fewer a step."""
        if self._buffers is None or self._buffers[0] != rows:
            spec = self.spec
            floats = self.kernel.step_floats(rows, spec.hidden_size, self.layers[0].w_down.in_features,
                                             spec.num_heads, spec.num_kv_heads, spec.head_dim)
            self._buffers = (rows, torch.empty(rows, spec.hidden_size), torch.empty(floats))
        return self._buffers[1], self._buffers[2]

    def _kernel_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the kernel's decode step reads, as int64 addresses: a row per layer in abi.LAYER_FIELDS' order (the
        matrices, their int8 scales and biases, or 0, the norms) and abi.HEAD_FIELDS' (the lm_head's weight, its
        int8 scales or 0, the final norm). Built once: every weight update writes
        into these tensors in place (load_hf_weight; int8 quantizes into its own place too)."""
        if self._tables is None:
            rows = []
            for layer in self.layers:
                fields = {"n_in": layer.in_norm, "n_post": layer.post_norm}
                for name, m in (("qkv", layer.wqkv), ("o", layer.wo), ("gu", layer.w_gate_up), ("d", layer.w_down)):
                    fields.update({f"w_{name}": m._gemv_weight(), f"s_{name}": m._gemv_scale(), f"b_{name}": m.bias})
                rows.append([address(fields[f]) for f in abi.LAYER_FIELDS])
            head = {"h_w": self.lm_head._gemv_weight(), "h_s": self.lm_head._gemv_scale(), "h_norm": self.norm}
            self._tables = (torch.tensor(rows, dtype=torch.int64),
                            torch.tensor([address(head[f]) for f in abi.HEAD_FIELDS], dtype=torch.int64))
        return self._tables

    def logits(self, hidden: torch.Tensor, upcast: bool = True, normed: bool = True) -> torch.Tensor:
        """Hidden states [N,hidden] -> logits [N,vocab], computed in the model dtype like HF, then fp32 (or left in
        the model dtype with upcast=False, for a caller that upcasts only when it needs to). normed=False: hidden
        is before the final norm (forward's final_norm=False), which a decode step's few rows then take inside the
        lm_head's kernel call (one torch op fewer, ~30 us a step)."""
        if not normed and self.lm_head.fuses(hidden.numel() // hidden.shape[-1]):
            logits = self.lm_head.normed(hidden, self.norm, self.spec.rms_norm_eps)
        else:
            logits = self.lm_head(hidden if normed else rms_norm(hidden, self.norm, self.spec.rms_norm_eps))
        return logits.float() if upcast else logits

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF-named parameter (e.g. `model.layers.3.self_attn.k_proj.weight`) into the fused layout
        (final/engine/weights.py; an update of many is `load_weights`, which groups each matrix's parts)."""
        load_weights(self, [(name, tensor)])
