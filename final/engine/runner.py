"""ModelRunner: builds the tensors of one step (ids, positions, attention plan) and runs the model."""

from __future__ import annotations

from array import array

import torch

from final.engine.attention import DecodePlan, PrefillPlan, SlotSpan, flash_attn_for
from final.engine.kv_cache import KVCache, PrefixKV
from final.engine.lora import AdapterTable, LoraStep
from final.engine.model import CausalLM
from final.engine.sampler import top_k
from final.engine.sequence import Sequence

PROMPT_LOGPROB_CHUNK = 256  # prompt positions per log_softmax when scoring (256 x 49k vocab = 50 MB of fp32)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, adapters: AdapterTable | None = None,
                 share_prefill: bool = False):
        self.model = model
        self.cache = cache
        self.adapters = adapters  # LoRA adapters rows may run with (engine/lora.py)
        self.scale = model.spec.head_dim ** -0.5
        self.device = model.device
        self.flash = flash_attn_for(model.device, model.dtype)
        self.share_prefill = share_prefill  # rows of one prompt (n samples) take one prefill (the prefix cache's)
        self._table: tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor] | None] = ((), None)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run the new prompt tokens of `seqs` (each after its cartridge and cached prefix), fill their slots,
        return logits [n,V] of each last token (model dtype: the sampler upcasts when it needs to).

        Rows with the same prompt, prefix and scoring options as an earlier row of the batch (a prompt's n samples)
        are not run: they take that row's slot contents, logits and prompt logprobs. Also fills
        `seq.input_logprobs` for requests that asked for prompt logprobs.
        """
        firsts: dict[tuple, int] = {}
        runs, source = [], []  # the rows run, and for each row of the batch the index of the run that serves it
        for seq in seqs:
            key = (seq.cache_key, seq.own_start, seq.return_logprob, seq.logprob_start_len, seq.top_logprobs_num,
                   tuple(seq.prompt_ids)) if self.share_prefill else (id(seq),)
            if key not in firsts:
                firsts[key] = len(runs)
                runs.append(seq)
            source.append(firsts[key])
        self.cache.reserve(max(s.slot for s in seqs) + 1, 0)  # every row's slot, the shared ones' too
        logits = self._prefill(runs)
        for seq, i in zip(seqs, source):
            leader = runs[i]
            if leader is not seq:  # its prompt's K/V and logits are the leader's: nothing of it was computed here
                self.cache.move(leader.slot, seq.slot, len(leader.prompt_ids) - leader.own_start)
                seq.input_logprobs, seq.input_top_logprobs = leader.input_logprobs, leader.input_top_logprobs
                seq.cached_tokens = len(seq.prompt_ids)
        return logits[source] if len(runs) < len(seqs) else logits

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        starts = [s.hit_len for s in seqs]
        lengths = [len(s.prompt_ids) - m for s, m in zip(seqs, starts)]
        offsets = [m - s.own_start for s, m in zip(seqs, starts)]  # each row's first new token in its slot
        T = max(lengths)
        ids = self._long([s.prompt_ids[m:] + [0] * (T - n) for s, m, n in zip(seqs, starts, lengths)])
        first = self._long([s.prefix_len + m for s, m in zip(seqs, starts)])
        # a padded row's positions stop at its last token (past it they could leave the rope tables)
        positions = torch.minimum(first[:, None] + torch.arange(T, device=self.device),
                                  (first + self._long(lengths) - 1)[:, None])
        self.cache.reserve(max(s.slot for s in seqs) + 1, max(o + T for o in offsets))
        segments = []
        for seq, off in zip(seqs, offsets):
            if off:  # a cached prefix the decode cannot read where it lies: the row's own from here on
                self.cache.copy_in(seq.slot, seq.hit.segments)
                segments.append(seq.segments + (SlotSpan(seq.slot, off),))
            else:
                segments.append(seq.segments)
        plan = PrefillPlan(self.cache, [s.slot for s in seqs], None, self.scale, flash=self.flash,
                           offsets=offsets, segments=segments)
        hidden = self.model.forward(ids, positions, plan, lora=self._lora(seqs))
        last = hidden[torch.arange(len(seqs)), self._long(lengths) - 1]
        for row, seq in enumerate(seqs):
            if seq.return_logprob:
                self._prompt_logprobs(hidden[row], seq, starts[row])
        return self.model.logits(last, upcast=False)

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, first: int = 0) -> None:
        """SGLang's input_token_logprobs values: None for the first scored token, then log p(t_j | t_<j) from the
        fp32 log_softmax of the logits (HF's numbers); with top_logprobs_num, the k most likely at each position.
        hidden [L - first, hidden]: the prompt's rows from token `first` (a cached prefix stops at the start).
        Logits are made a chunk of positions at a time, so scoring a long prompt never holds a [T, V] matrix."""
        L = len(seq.prompt_ids)
        start = seq.logprob_start_len if seq.logprob_start_len >= 0 else L - 1
        values: list[float | None] = [None]
        tops: list[list[tuple[float, int]] | None] = [None]
        for lo in range(start, L - 1, PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, L - 1)
            logprobs = torch.log_softmax(self.model.logits(hidden[lo - first:hi - first]), dim=-1)
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
        step = array("q", [s.output_ids[-1] for s in seqs] + [n + s.prefix_len + s.own_start
                                                               for n, s in zip(cached, seqs)] + cached)
        self.cache.reserve(B, max(cached) + 1)
        groups: dict[tuple[int, ...], tuple[list[int], tuple[PrefixKV, ...]]] = {}
        for row, seq in enumerate(seqs):
            if seq.segments:
                groups.setdefault(tuple(map(id, seq.segments)), ([], seq.segments))[0].append(row)
        plan = DecodePlan(self.cache, step, [(self._long(r), p) for r, p in groups.values()], self.scale,
                          flash=self.flash, table=self._segment_table(seqs) if groups else None,
                          kernel=self.model.kernel)
        return self.model.decode(plan, lora=self._lora(seqs))

    def _lora(self, seqs: list[Sequence]) -> LoraStep | None:
        """The step's adapter deltas; None when no row has an adapter (the kernel's fast paths)."""
        if self.adapters is None or all(s.lora is None for s in seqs):
            return None
        return self.adapters.step([s.lora for s in seqs])

    def _segment_table(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' prefix segments as the kernel reads them: [B, S, layers, 2] K/V addresses and [B, S] lengths.
        A row's segments do not change while it runs, so the table is kept until the running rows change."""
        key = tuple(s.uid for s in seqs)
        if self._table[0] != key:
            width, layers = max(len(s.segments) for s in seqs), self.model.spec.num_layers
            table = torch.zeros(len(seqs), width, layers, 2, dtype=torch.int64)
            lengths = torch.zeros(len(seqs), width, dtype=torch.int64)
            for row, seq in enumerate(seqs):
                for i, seg in enumerate(seq.segments):
                    table[row, i] = seg.addresses()
                    lengths[row, i] = seg.length
            self._table = (key, (table, lengths))
        return self._table[1]

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
