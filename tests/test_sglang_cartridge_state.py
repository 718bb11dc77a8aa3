"""SGLangCartridges' own state, without an engine: every read of the loaded/retired ids happens under its lock
(calls reach it from several threads on SGLang 0.5.12, a load among them)."""

from __future__ import annotations

import pytest

from final.errors import PromptError
from final.rollout.sglang.cartridges import ModelDims, SGLangCartridges


class Guarded(dict):
    """A dict whose readers must hold `lock` (an RLock): reading without it raises, as a concurrent load would
    (RuntimeError: dictionary changed size during iteration)."""

    def __init__(self, lock, *args):
        super().__init__(*args)
        self._guard = lock

    def _check(self):
        if not self._guard._is_owned():
            raise AssertionError("read without the lock")

    def values(self):
        self._check()
        return super().values()

    def __iter__(self):
        self._check()
        return super().__iter__()


def test_plain_prompt_checks_read_the_loaded_ids_under_the_lock():
    carts = SGLangCartridges(engine=None, dims=ModelDims(2, 2, 16, 100), tokenizer_size=100, special_ids=[0])
    try:
        carts._loaded = Guarded(carts._lock, {"doc": (99, 5)})
        with pytest.raises(PromptError, match="reserved for cartridges"):
            carts.check_plain_prompt([99, 1], 0)
        carts.check_plain_prompt([7, 1], 0)
        assert carts.active() and carts.cartridge_ids() == ["doc"]
        assert carts.prefixes([[7, 1]], [None], [{}], context_len=64) == [[]]
    finally:
        carts.close()
