"""ModelRunner: builds the tensors of one step (ids, positions, attention plan) and runs the model."""

from __future__ import annotations

from array import array

import torch

from final.engine.attention import DecodePlan, PrefillPlan, flash_attn_for
from final.engine.kv_cache import KVCache, PrefixKV
from final.engine.lora import AdapterTable, LoraStep
from final.engine.model import CausalLM
from final.engine.sampler import top_k
from final.engine.sequence import Sequence

PROMPT_LOGPROB_CHUNK = 256  # prompt positions per log_softmax when scoring (256 x 49k vocab = 50 MB of fp32)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, adapters: AdapterTable | None = None):
        self.model = model
        self.cache = cache
        self.adapters = adapters  # LoRA adapters rows may run with (engine/lora.py)
        self.scale = model.spec.head_dim ** -0.5
        self.device = model.device
        self.flash = flash_attn_for(model.device, model.dtype)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run the prompts of `seqs` (same prefix), fill their slots, return logits [n,V] of each last token
        (model dtype: the sampler upcasts when it needs to).

        Also fills `seq.input_logprobs` for requests that asked for prompt logprobs.
        """
        prefix = seqs[0].prefix
        lengths = [len(s.prompt_ids) for s in seqs]
        T = max(lengths)
        ids = self._long([s.prompt_ids + [0] * (T - len(s.prompt_ids)) for s in seqs])
        positions = (torch.arange(T, device=self.device) + (prefix.length if prefix else 0)).expand(len(seqs), T)
        self.cache.reserve(max(s.slot for s in seqs) + 1, T)
        plan = PrefillPlan(self.cache, [s.slot for s in seqs], prefix, self.scale, flash=self.flash)
        hidden = self.model.forward(ids, positions, plan, lora=self._lora(seqs))
        last = hidden[torch.arange(len(seqs)), self._long(lengths) - 1]
        for row, seq in enumerate(seqs):
            if seq.return_logprob:
                self._prompt_logprobs(hidden[row], seq)
        return self.model.logits(last, upcast=False)

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence) -> None:
        """SGLang's input_token_logprobs values: None for the first scored token, then log p(t_j | t_<j) from the
        fp32 log_softmax of the logits (HF's numbers); with top_logprobs_num, the k most likely at each position.
        Logits are made a chunk of positions at a time, so scoring a long prompt never holds a [T, V] matrix."""
        L = len(seq.prompt_ids)
        start = seq.logprob_start_len if seq.logprob_start_len >= 0 else L - 1
        values: list[float | None] = [None]
        tops: list[list[tuple[float, int]] | None] = [None]
        for lo in range(start, L - 1, PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, L - 1)
            logprobs = torch.log_softmax(self.model.logits(hidden[lo:hi]), dim=-1)
            targets = self._long(seq.prompt_ids[lo + 1 : hi + 1])
            values += logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            if seq.top_logprobs_num:
                tops += top_k(logprobs, seq.top_logprobs_num)
        seq.input_logprobs = values
        seq.input_top_logprobs = tops if seq.top_logprobs_num else None

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for every running row (seqs[i] lives in slot i). Returns logits [B,V] in the model dtype."""
        B = len(seqs)
        cached = [s.cached_len for s in seqs]
        step = array("q", [s.output_ids[-1] for s in seqs] + [n + s.prefix_len for n, s in zip(cached, seqs)] + cached)
        self.cache.reserve(B, max(cached) + 1)
        groups: dict[int, tuple[list[int], PrefixKV]] = {}
        for row, seq in enumerate(seqs):
            if seq.prefix is not None:
                groups.setdefault(id(seq.prefix), ([], seq.prefix))[0].append(row)
        plan = DecodePlan(self.cache, step, [(self._long(r), p) for r, p in groups.values()], self.scale,
                          flash=self.flash)
        return self.model.decode(plan, lora=self._lora(seqs))

    def _lora(self, seqs: list[Sequence]) -> LoraStep | None:
        """The step's adapter deltas; None when no row has an adapter (the kernel's fast paths)."""
        if self.adapters is None or all(s.lora is None for s in seqs):
            return None
        return self.adapters.step([s.lora for s in seqs])

    def forward_full(self, ids: list[int], prefix: PrefixKV | None, capture: bool = False
                     ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits [T,V] for every position of one sequence, on a scratch cache (running rows untouched).

        With capture=True also returns each layer's post-RoPE (K, V) as [Hkv,T,D]: a cartridge of the text.
        """
        spec = self.model.spec
        scratch = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.model.dtype, self.device, len(ids))
        scratch.reserve(1, len(ids))
        plan = PrefillPlan(scratch, [0], prefix, self.scale, capture=capture, flash=self.flash)
        positions = (torch.arange(len(ids), device=self.device) + (prefix.length if prefix else 0))[None]
        hidden = self.model.forward(self._long([ids]), positions, plan)
        return self.model.logits(hidden[0]), [(k[0], v[0]) for k, v in plan.captured]
