"""How a pool of replicas (final.pool) cuts a call into chunks, and puts their rows back in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from final.errors import EngineError
from final.outputs import GenerationOutput

# A replica runs one chunk at a time (InferenceEngine serializes its calls), so a chunk is that replica's batch.
# More chunks per replica share the load more finely (a fast replica takes more; a dead one loses less); bigger
# chunks keep the engine's batch full (a decode step costs nearly the same for 8 rows as for 32). Hence about
# CHUNKS_PER_REPLICA chunks each, but no fewer than MIN_CHUNK_ROWS rows (or an equal share of a small call).
CHUNKS_PER_REPLICA = 4
MIN_CHUNK_ROWS = 32



@dataclass(frozen=True)
class Chunk:
    """Samples [s0, s0+k) of prompts [p0, p1): one InferenceEngine.generate call on one replica."""

    p0: int
    p1: int
    s0: int
    k: int

    def rows(self) -> list[tuple[int, int]]:
        """(prompt, sample) of each row, in the order the replica returns them (prompt-major)."""
        return [(p, s) for p in range(self.p0, self.p1) for s in range(self.s0, self.s0 + self.k)]


def plan_chunks(prompts: int, n: int, replicas: int, max_rows: int, chunk_rows: int | None = None) -> list[Chunk]:
    """Cut prompts x n rows into chunks of about chunk_rows rows (default: see CHUNKS_PER_REPLICA; at most
    max_rows, the engine's running batch). A prompt's samples are split only when n alone exceeds that."""
    rows = prompts * n
    if chunk_rows is None:
        share = -(-rows // replicas)
        chunk_rows = min(max_rows, max(-(-rows // (replicas * CHUNKS_PER_REPLICA)), min(MIN_CHUNK_ROWS, share)))
    size = max(1, chunk_rows)
    if n > size:
        return [Chunk(p, p + 1, s, min(size, n - s)) for p in range(prompts) for s in range(0, n, size)]
    per = size // n
    return [Chunk(p, min(p + per, prompts), 0, n) for p in range(0, prompts, per)]


def assemble(chunks: list[Chunk], done: dict[int, tuple[int, Any]], n: int, version: int) -> GenerationOutput:
    """Chunk outputs -> one GenerationOutput, rows prompt-major as InferenceEngine returns them; each row says the
    replica that ran it and the pool's weights version (a restarted replica replays the updates: its own count
    can differ)."""
    total = sum(len(c.rows()) for c in chunks)
    completions: list = [None] * total
    token_ids: list = [None] * total
    metadata: list = [None] * total
    for c, (replica, out) in done.items():
        rows = chunks[c].rows()
        if len(out.completions) != len(rows):
            raise EngineError(f"replica {replica} returned {len(out.completions)} rows for a chunk of {len(rows)}")
        for j, (p, s) in enumerate(rows):
            g = p * n + s
            completions[g], token_ids[g] = out.completions[j], out.token_ids[j]
            meta = out.metadata[j] if j < len(out.metadata) else {}
            metadata[g] = {**meta, "prompt_index": p, "sample_index": s, "replica": replica, "weights_version": version}
    return GenerationOutput(completions, token_ids, metadata, n)
