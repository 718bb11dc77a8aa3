"""WeightSync: an InferenceEngine's weights over time - updates, release/resume (veRL's sleep mode), versions.

The rules (docs/guides/train-a-policy.md):
- An update is checked whole before anything is written (final.weights: names, shapes, dtypes, NaN/Inf), by the
  backend that applies it; a refused update leaves the old weights serving, bit for bit, and the version unchanged.
  A LoRA adapter (a PEFT folder, a PeftModel, lora tensors with a peft_config) is an update like any other: the
  backend merges it into its modules' kept bases (final.adapters.merge), and it is versioned.
- Calls and updates never overlap (final.versions.PolicyVersions): an update waits for the calls in flight, which
  finish on the old weights; calls made meanwhile wait and run on the new ones. Every row says its version.
- Caches made by the old weights go: SGLang's radix cache is flushed by the backend; cartridges (KV caches trained
  for one set of weights) are unloaded and refused until loaded again, unless the update says keep_cartridges.
- release() frees what the engine can rebuild (its KV pool; SGLang's memory saver, where on, its weights too);
  the next call, or update, resumes first: generating while released is never an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

from final.adapters import peft_update
from final.errors import UnsupportedError
from final.rollout import Backend
from final.versions import PolicyVersions
from final.weights import named_tensors

TAGS = ("weights", "kv_cache")  # veRL's resume tags, in the order its trainer resumes them


class WeightSync:
    """InferenceEngine's weight updates, release and resume: the rules are in this module's docstring."""

    def __init__(self, backend_name: str, rollout: Backend, complete: Callable[[Any], Any]):
        """complete(coroutine) runs a backend coroutine to its end from a blocking caller."""
        self.backend_name, self.rollout, self._complete = backend_name, rollout, complete
        self.versions = PolicyVersions()
        self.cartridges: Any = None  # the engine's CartridgeService, told of every update
        self._released: set[str] = set()
        self._resume_lock = threading.Lock()

    @property
    def version(self) -> int:
        """How many updates the engine has taken (0: the weights it loaded)."""
        return self.versions.version

    # ---- updates ---------------------------------------------------------------------------------------------
    def update(self, weights: Any, *, keep_cartridges: bool = False, peft_config: Any = None) -> int:
        """Apply an update (see InferenceEngine.update_weights); returns the new version."""
        caps = self.rollout.capabilities
        if not caps.weight_updates:
            raise UnsupportedError(self.backend_name, "update_weights", dict(caps.notes).get(
                "update_weights", f"the {self.backend_name} backend serves fixed weights"))
        lora = peft_update(weights)  # a PEFT folder or PeftModel: merged by the backend from its kept base
        if lora is not None:
            weights, peft_config = lora
        by_path = isinstance(weights, (str, Path)) and caps.weights_by_path
        named = None if by_path else named_tensors(weights)  # a generator is consumed before calls are held
        adapter = {"peft_config": peft_config} if peft_config is not None else {}
        with self.versions.writing() as version:
            self._resume(list(TAGS))
            # keep_cartridges reaches a backend whose engine is elsewhere (a server), where the same rule holds
            if by_path:
                self._complete(self.rollout.update_weights_from_disk(str(weights), keep_cartridges))
            else:
                self._complete(self.rollout.update_weights(iter(named), keep_cartridges=keep_cartridges, **adapter))
            if self.cartridges is not None:
                self.cartridges.weights_changed(version, keep=keep_cartridges)
        return version

    # ---- sleep mode ------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Free the engine's rebuildable memory once the calls in flight have finished."""
        with self.versions.exclusive():
            if set(TAGS) - self._released:
                self._complete(self.rollout.release())
                self._released = set(TAGS)

    def resume(self, tags: list[str] | None = None) -> None:
        """Bring back what release() freed (veRL's tags: weights, kv_cache; None: both)."""
        wanted = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in TAGS]
        if unknown:
            raise UnsupportedError(self.backend_name, "tags", f"resume tags are {list(TAGS)}, not {unknown}")
        with self.versions.exclusive():
            self._resume(wanted)

    def _resume(self, tags: list[str]) -> None:
        with self._resume_lock:
            todo = [t for t in TAGS if t in tags and t in self._released]
            if todo:
                self._complete(self.rollout.resume(todo))
                self._released -= set(todo)

    # ---- calls -----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self) -> Iterator[int]:
        """Hold the weights for a blocking call (resumed first if released); yields their version."""
        with self.versions.reading() as version:
            if self._released:
                self._resume(list(TAGS))
            yield version

    @contextlib.asynccontextmanager
    async def areading(self) -> AsyncIterator[int]:
        """reading() for an event loop (a resume runs on a worker thread)."""
        async with self.versions.areading() as version:
            if self._released:
                await asyncio.get_running_loop().run_in_executor(None, self._resume, list(TAGS))
            yield version
