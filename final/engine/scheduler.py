"""Scheduler: who runs next. Owns the waiting queue and the running batch (in slot order).

Policy (as nano-vllm / vLLM v0): admit waiting requests first, as one prefill batch bounded by max_prefill_tokens,
max_running and the KV memory budget; otherwise run one decode step for every running row. Requests join and
leave the running batch between steps. With a prefix cache, each admitted row first attaches to its longest cached
prefix (SGLang's match_prefix: at most the prompt less its last token, which must run for logits, and never past
logprob_start_len when prompt logprobs are asked for), so its prefill and its room in the row cache are only what
is new; the cache's bytes count against the same budget, and unlocked entries are evicted (least recently used)
before a batch would pass it.
"""

from __future__ import annotations

from collections import deque

from final.engine.kv_cache import KVCache
from final.engine.prefix_cache import MIN_HIT, PrefixCache
from final.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache: KVCache, max_running: int, max_prefill_tokens: int, kv_budget_bytes: int,
                 prefix_cache: PrefixCache | None = None, by_reference: bool = True):
        self.cache = cache
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_budget_bytes = kv_budget_bytes
        self.prefix_cache = prefix_cache
        self.by_reference = by_reference  # rows attend to cached prefixes where they lie (else: copied into slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _fits(self, rows: int, tokens: int) -> bool:
        """rows slots of tokens each beside the prefix cache, under the budget (evicting unlocked entries first)."""
        need = rows * tokens * self.cache.bytes_per_token
        cached = self.prefix_cache.nbytes if self.prefix_cache is not None else 0
        if need + cached > self.kv_budget_bytes and cached:
            self.prefix_cache.evict(need + cached - self.kv_budget_bytes)
            cached = self.prefix_cache.nbytes
        return need + cached <= self.kv_budget_bytes

    def too_big(self, seq: Sequence) -> bool:
        """A request that cannot run even alone under the memory budget."""
        return rows_bytes(1, seq.reserved_tokens, self.cache) > self.kv_budget_bytes

    def _attach(self, seq: Sequence) -> None:
        """Match seq against the prefix cache (locking its path) and take the hit."""
        cache, hit = self.prefix_cache, None
        if cache is not None:
            limit = len(seq.prompt_ids) - 1
            if seq.return_logprob and 0 <= seq.logprob_start_len < limit:
                limit = seq.logprob_start_len  # its prompt logprobs need the hidden states from there on
            hit = cache.match(seq.cache_key, seq.prompt_ids, limit, MIN_HIT) if limit >= MIN_HIT else None
            if hit is not None:
                cache.lock(hit)
            seq.cache_generation = cache.generation
        seq.attach(hit, self.by_reference)

    def detach(self, seq: Sequence) -> None:
        """Let go of seq's cached prefix (a row that finished, or was not admitted after all)."""
        if seq.hit is not None and self.prefix_cache is not None:
            self.prefix_cache.unlock(seq.hit)
        seq.hit = None

    def next_prefill(self) -> list[Sequence]:
        """Pop the next prefill batch: waiting rows in order while they fit."""
        if not self.waiting:
            return []
        batch: list[Sequence] = []
        tokens = 0
        longest = max((s.reserved_tokens for s in self.running), default=0)
        for seq in list(self.waiting):
            self._attach(seq)
            rows = len(self.running) + len(batch) + 1
            longest_after = max(longest, seq.reserved_tokens)
            new = len(seq.prompt_ids) - seq.hit_len
            if (rows > self.max_running or (batch and tokens + new > self.max_prefill_tokens)
                    or not self._fits(rows, longest_after)):
                self.detach(seq)
                seq.attach(None, self.by_reference)  # it waits with nothing of the cache held
                break
            batch.append(seq)
            tokens += new
            longest = longest_after
        for seq in batch:
            self.waiting.remove(seq)
            seq.slot = len(self.running)
            seq.status = Status.RUNNING
            self.running.append(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.stats.hits += sum(s.hit is not None for s in batch)
            self.prefix_cache.stats.hit_tokens += sum(s.hit_len for s in batch)
        return batch

    def remove(self, done: list[Sequence]) -> None:
        """Take finished rows out of the running batch, moving the last row into each freed slot."""
        for seq in sorted(done, key=lambda s: s.slot, reverse=True):
            last = self.running[-1]
            if last is not seq:
                self.cache.move(last.slot, seq.slot, last.cached_len)
                last.slot = seq.slot
                self.running[seq.slot] = last
            self.running.pop()
            seq.status = Status.FINISHED
            seq.slot = -1

    def drop_waiting(self, pred) -> list[Sequence]:
        gone = [s for s in self.waiting if pred(s)]
        for s in gone:
            self.waiting.remove(s)
            s.status = Status.FINISHED
        return gone


def rows_bytes(rows: int, tokens: int, cache: KVCache) -> int:
    return rows * tokens * cache.bytes_per_token
