"""Cartridges on SGLang: reserved token ids per cartridge, KV injected into the scheduler's radix cache.

A cartridge of T tokens gets one reserved token id r, and its prefix is R = [r] * T. The scheduler (see
scheduler.py) writes the cartridge's KV into T pool slots and caches them under R, locked. A request for
cartridges (a, b) is sent as R_a + R_b + prompt: the radix cache serves R_a + R_b, the prompt is prefilled at
positions p.. exactly as the embedded engine's prefix does. The engine wrapper prepends R, checks the cache hit
(`cached_tokens` >= len(R), else the output would be garbage) and strips R from what it returns.

Reserved ids are never produced by the tokenizer (ids past it first, then the highest non-special ids); a prompt
without cartridges that starts with one is refused. An unloaded cartridge's id is reused only after the next
flush, which empties the radix cache of any entry still keyed by it.

Same interface as EmbeddedEngine: load_cartridge(id, keys, values), unload_cartridge(id), cartridge_ids(). Both
lanes' engine wrappers (engine_052.py, engine_0512.py) plan a call's prefixes with `prefixes` and check each answer
with `check_prefix_hit`. Calls may come from several threads on 0.5.12 (its engine has no owner thread for them):
one lock serialises this object's state and the RPC socket (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import torch

from final.errors import CartridgeError, EngineError, PromptError
from final.rollout.sglang.procs import alive

RPC_POLL_MS = 500
# Compositions of 2+ cartridges held injected at once (each locks pool slots for its later members); past this the
# least recently used one is released, so no sequence of orderings can fill the KV pool.
MAX_COMPOSITIONS = 16


@dataclass(frozen=True)
class ModelDims:
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int  # embedding rows: every id below this is accepted by SGLang

    @classmethod
    def of(cls, hf_config) -> "ModelDims":
        """From a transformers config (a multimodal model's text_config)."""
        text = getattr(hf_config, "text_config", hf_config)
        heads = text.num_attention_heads
        return cls(layers=text.num_hidden_layers, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab_size=text.vocab_size)


class SGLangCartridges:
    def __init__(self, engine, dims: ModelDims, tokenizer_size: int, special_ids: Sequence[int]):
        self._engine = engine  # an sglang Engine: collective_rpc
        self.dims = dims
        past_tokenizer = list(range(dims.vocab_size - 1, tokenizer_size - 1, -1))
        specials = set(special_ids)
        in_tokenizer = [i for i in range(min(tokenizer_size, dims.vocab_size) - 1, -1, -1) if i not in specials]
        self._free = past_tokenizer + in_tokenizer  # preferred first
        self._retired: list[int] = []
        self._loaded: dict[str, tuple[int, int]] = {}  # id -> (reserved token, length)
        self._composed: OrderedDict[tuple[str, ...], None] = OrderedDict()  # 2+ ids, least recently used first
        self.max_compositions = MAX_COMPOSITIONS
        self._dir = tempfile.mkdtemp(prefix="final-sglang-cartridges-")  # mode 0700
        self._lock = threading.RLock()

    # ---- EmbeddedEngine's interface --------------------------------------------------------------------
    def load_cartridge(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Inject a cartridge (per-layer K/V [1,Hkv,T,D] or [Hkv,T,D], post-RoPE); returns its length T."""
        with self._lock:
            return self._load(cartridge_id, keys, values)

    def _load(self, cartridge_id: str, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        if not isinstance(cartridge_id, str) or not cartridge_id:
            raise CartridgeError("cartridge id must be a non-empty string", field="id")
        ks, vs = self._check(cartridge_id, keys, "keys"), self._check(cartridge_id, values, "values")
        length = ks[0].shape[0]
        if length != vs[0].shape[0]:
            raise CartridgeError(f"keys have {length} tokens, values {vs[0].shape[0]}", file=cartridge_id,
                                 field="values")
        if cartridge_id in self._loaded:  # replace, as the embedded engine does
            self.unload_cartridge(cartridge_id)
        if not self._free:
            raise CartridgeError(f"no token id left to reserve ({len(self._loaded)} cartridges loaded); "
                                 "unload one first", file=cartridge_id)
        reserved = self._free.pop(0)
        path = os.path.join(self._dir, hashlib.sha256(cartridge_id.encode()).hexdigest()[:24] + ".safetensors")
        from safetensors.torch import save_file

        tensors = {f"k.{i}": k for i, k in enumerate(ks)} | {f"v.{i}": v for i, v in enumerate(vs)}
        save_file(tensors, path)
        try:
            self._rpc(cartridge_id, "final_cartridge_load", cartridge_id=cartridge_id, path=path, reserved=reserved)
        except CartridgeError:
            self._free.insert(0, reserved)
            raise
        finally:
            os.unlink(path)  # the scheduler keeps its own resident copy
        self._loaded[cartridge_id] = (reserved, length)
        return length

    def unload_cartridge(self, cartridge_id: str) -> bool:
        """Unlock its KV in the radix cache: the slots are evictable (freed when the pool needs room, or by a
        flush), and its reserved id is retired until the next flush."""
        with self._lock:
            if cartridge_id not in self._loaded:
                return False
            self._rpc(cartridge_id, "final_cartridge_unload", cartridge_id=cartridge_id)
            reserved, _ = self._loaded.pop(cartridge_id)
            self._retired.append(reserved)
            for ids in [ids for ids in self._composed if cartridge_id in ids]:
                del self._composed[ids]
            return True

    def cartridge_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._loaded)

    def memory(self) -> dict:
        """Where cartridge KV lives in the scheduler: host_bytes / device_bytes of its resident copies (device_bytes
        is 0 by design), pinned (on CUDA), pool_tokens held by injected cartridges, pool_free, kv_released."""
        import json

        path = os.path.join(self._dir, "memory.json")
        with self._lock:
            self._rpc("(all)", "final_cartridge_memory", path=path)
        try:
            with open(path) as f:
                return json.load(f)
        finally:
            os.unlink(path)

    # ---- used by the engine wrapper ----------------------------------------------------------------------
    def prefixes(self, rows: Sequence[Sequence[int]], wanted: Sequence[Sequence[str] | None], params: Sequence[dict],
                 context_len: int) -> list[list[int]]:
        """Per row, the reserved ids R to prepend (empty for a row without cartridges, whose first id must not be
        reserved); a row whose cartridges + prompt + max_new_tokens exceed the context is refused."""
        out = []
        for i, (row, cartridges, p) in enumerate(zip(rows, wanted, params)):
            # the prompt after R must not begin with a reserved id either: R + [r_b]... would hit (a, b)'s KV
            self.check_plain_prompt(row, i)
            if not cartridges:
                out.append([])
                continue
            room = context_len - 1 - len(row) - (p.get("max_new_tokens") or 0)  # checked before any injection
            out.append(self.prefix(tuple(cartridges), i, room=room))
        return out

    def prefix(self, cartridge_ids: tuple[str, ...], index: int | None = None, room: int | None = None) -> list[int]:
        """The reserved ids R to prepend for these cartridges (injecting the composition on first use). With `room`,
        a composition longer than that is refused before anything is injected or locked."""
        with self._lock:
            return self._prefix(cartridge_ids, index, room)

    def _prefix(self, cartridge_ids: tuple[str, ...], index: int | None, room: int | None) -> list[int]:
        unknown = [c for c in cartridge_ids if c not in self._loaded]
        if unknown:
            raise PromptError(f"cartridge(s) {unknown} are not loaded (loaded: {self.cartridge_ids()})", index)
        if len(set(cartridge_ids)) != len(cartridge_ids):
            raise PromptError(f"cartridges {list(cartridge_ids)} repeat an id", index)
        length = sum(self._loaded[c][1] for c in cartridge_ids)
        if room is not None and length > room:
            raise PromptError(f"cartridges {list(cartridge_ids)} ({length} tokens) + prompt + max_new_tokens do not "
                              f"fit the context ({length - room} tokens over)", index)
        if len(cartridge_ids) > 1:
            self._compose(cartridge_ids)
        return [t for c in cartridge_ids for t in [self._loaded[c][0]] * self._loaded[c][1]]

    def _compose(self, cartridge_ids: tuple[str, ...]) -> None:
        """Inject a composition on first use; hold at most max_compositions, releasing the least recently used."""
        if cartridge_ids in self._composed:
            self._composed.move_to_end(cartridge_ids)
            return
        while len(self._composed) >= self.max_compositions:
            oldest = next(iter(self._composed))
            self._rpc(oldest[0], "final_cartridge_release", cartridge_ids=list(oldest))
            del self._composed[oldest]
        self._rpc(cartridge_ids[0], "final_cartridge_compose", cartridge_ids=list(cartridge_ids))
        self._composed[cartridge_ids] = None

    def check_plain_prompt(self, ids: Sequence[int], index: int) -> None:
        """A prompt must not begin with a reserved id (it would hit a cartridge's KV, or a retired one's)."""
        with self._lock:  # loads and unloads change these from other threads
            reserved = {r for r, _ in self._loaded.values()} | set(self._retired)
        if ids and ids[0] in reserved:
            raise PromptError(f"token id {ids[0]} is reserved for cartridges on the SGLang backend and cannot start "
                              f"a prompt", index)

    def active(self) -> bool:
        """Whether requests need looking at: cartridges loaded, or ids retired but possibly still cached."""
        with self._lock:
            return bool(self._loaded or self._retired)

    def retired(self) -> list[int]:
        """The ids retired so far: take this before a flush and hand it to after_flush (an id retired while the
        flush ran may still be cached)."""
        with self._lock:
            return list(self._retired)

    def after_flush(self, retired: Sequence[int]) -> None:
        """The radix cache was emptied after `retired` was taken: those ids can be reserved anew."""
        with self._lock:
            done = [r for r in retired if r in self._retired]
            self._retired = [r for r in self._retired if r not in done]
            self._free.extend(done)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- internals ---------------------------------------------------------------------------------------
    def _check(self, cartridge_id: str, tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        d = self.dims
        if not isinstance(tensors, (list, tuple)) or len(tensors) != d.layers:
            got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise CartridgeError(f"needs one tensor per layer ({d.layers}), got {got}", file=cartridge_id, field=name)
        out = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4) or (t.dim() == 4 and t.shape[0] != 1):
                raise CartridgeError(f"layer {i} must be [1,Hkv,T,D] or [Hkv,T,D]", file=cartridge_id, field=name)
            t = t[0] if t.dim() == 4 else t
            if t.shape[0] != d.kv_heads or t.shape[2] != d.head_dim or t.shape[1] < 1:
                raise CartridgeError(f"layer {i} has shape {tuple(t.shape)}, the model needs [{d.kv_heads}, T>=1, "
                                     f"{d.head_dim}]", file=cartridge_id, field=name)
            if t.shape[1] != tensors[0].shape[-2]:
                raise CartridgeError(f"layer {i} has {t.shape[1]} tokens, layer 0 {tensors[0].shape[-2]}",
                                     file=cartridge_id, field=name)
            out.append(t.detach().to("cpu").transpose(0, 1).contiguous())  # the pool's layout: [T, Hkv, D]
        return out

    def _rpc(self, name: str, method: str, **params) -> None:
        """SGLang's Engine.collective_rpc, except that waiting for the answer gives up if the scheduler dies
        (collective_rpc would block on the socket forever)."""
        from sglang.srt.managers.io_struct import RpcReqInput

        import zmq

        sock = self._engine.send_to_rpc
        while not sock.poll(RPC_POLL_MS, zmq.POLLOUT):  # no peer yet (connecting) or any more (dead)
            self._check_alive(method, name)
        sock.send_pyobj(RpcReqInput(method=method, parameters=params))
        while not sock.poll(RPC_POLL_MS):
            self._check_alive(method, name)
        reply = sock.recv_pyobj()
        if not reply.success:
            raise CartridgeError(f"the SGLang scheduler refused it: {reply.message}", file=name)

    def _check_alive(self, method: str, name: str) -> None:
        if not all(alive(p) for p in self._engine.processes):
            raise EngineError(f"SGLang's scheduler died while serving {method} for cartridge {name!r}")


def shift_starts(starts: int | None | list, prefixes: list[list[int]]) -> list[int]:
    """SGLang's logprob_start_len per row, moved past the row's reserved ids R: a start inside R would make the
    scheduler recompute R instead of taking it from the radix cache (its prefix match stops at the start)."""
    starts = starts if isinstance(starts, list) else [starts] * len(prefixes)
    return [-1 if s is None or s < 0 else s + len(p) for s, p in zip(starts, prefixes)]  # -1: SGLang's default


def check_prefix_hit(out: dict, plen: int) -> None:
    """Check that a cartridge's reserved ids were served from the radix cache (else the answer attended to
    whatever the reserved ids' embeddings compute: garbage). The counts stay as SGLang gives them: prompt_tokens
    includes the cartridge's p tokens and cached_tokens at least p (final.outputs' usage)."""
    if not plen:
        return
    meta = out["meta_info"]
    reason = meta.get("finish_reason") or {}
    if meta.get("cached_tokens", 0) < plen and reason.get("type") != "abort":
        raise EngineError(f"a cartridge prefix of {plen} tokens was not served from SGLang's radix cache "
                          f"(cached_tokens={meta.get('cached_tokens')}); its KV was evicted or flushed")


FLUSH_TRIES = 5


async def flush_until_idle(flush: Callable[[], Awaitable[Any]]) -> Any:
    """SGLang's flush_cache, retried up to FLUSH_TRIES times 50-200 ms apart. Its scheduler refuses a flush while
    its running batch holds a request, and a request whose answer the caller already has can still be there for a
    loop iteration: under load (CI beside benchmarks) veRL's flush right after a generate was refused, which left
    an unloaded cartridge's reserved id retired. A flush refused every time (requests really running) is returned
    as SGLang gave it."""
    for attempt in range(FLUSH_TRIES):
        out = await flush()
        if out.success or attempt == FLUSH_TRIES - 1:
            return out
        await asyncio.sleep(0.05 * (attempt + 1))

