"""Scheduler: who runs next. Owns the waiting queue and the running batch (in slot order).

Policy (as nano-vllm / vLLM v0): admit waiting requests first, as one prefill batch of requests that share
the same cartridge prefix, bounded by max_prefill_tokens, max_running and the KV memory budget; otherwise run
one decode step for every running row. Requests join and leave the running batch between steps.
"""

from __future__ import annotations

from collections import deque

from final.engine.kv_cache import KVCache
from final.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache: KVCache, max_running: int, max_prefill_tokens: int, kv_budget_bytes: int):
        self.cache = cache
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_budget_bytes = kv_budget_bytes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _fits(self, rows: int, tokens: int) -> bool:
        return rows * tokens * self.cache.bytes_per_token <= self.kv_budget_bytes

    def too_big(self, seq: Sequence) -> bool:
        """A request that cannot run even alone under the memory budget."""
        return not self._fits(1, seq.reserved_tokens)

    def next_prefill(self) -> list[Sequence]:
        """Pop the next prefill batch: the head request plus later ones with the same prefix that fit."""
        if not self.waiting:
            return []
        head = self.waiting[0]
        batch: list[Sequence] = []
        tokens = 0
        longest = max((s.reserved_tokens for s in self.running), default=0)
        for seq in list(self.waiting):
            if seq.prefix is not head.prefix:
                continue
            rows = len(self.running) + len(batch) + 1
            longest_after = max(longest, seq.reserved_tokens)
            if rows > self.max_running or not self._fits(rows, longest_after):
                break
            if batch and tokens + len(seq.prompt_ids) > self.max_prefill_tokens:
                break
            batch.append(seq)
            tokens += len(seq.prompt_ids)
            longest = longest_after
        for seq in batch:
            self.waiting.remove(seq)
            seq.slot = len(self.running)
            seq.status = Status.RUNNING
            self.running.append(seq)
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
