"""final's grammar backend inside SGLang 0.5.12's scheduler (the verl09 lane): the embedded engine's own compiler
(final/engine/grammar.py: llguidance, structural tags with xgrammar's semantics), so both backends constrain the
same request the same way.

SGLang 0.5.12 looks a `grammar_backend` name up in its GRAMMAR_BACKEND_REGISTRY first; scheduler.py registers
`final` in the scheduler child before SGLang's own start (sglang/rollout_0512.py names it). Imported only there.
The scheduler's contract (constrained/base_grammar_backend.py): a backend compiles on its thread pool (dispatch_*),
returns an InvalidGrammarObject for a bad constraint (the request is aborted with its message), and caches one
object per key whose `copy()` each later request gets; a grammar object fills a mask row per step, is applied to
the logits before sampling, accepts the chosen token (ValueError: the request is aborted), and is terminated once
a stop token is taken where the grammar may end.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.constrained.base_grammar_backend import (BaseGrammarBackend, BaseGrammarObject,
                                                         InvalidGrammarObject, register_grammar_backend)

from final.engine.grammar import GrammarCompiler, GrammarError, RowGrammar, banned_tokens
from final.errors import SamplingError

NAME = "final"
KEYS = {"json": "json_schema", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}


class FinalGrammar(BaseGrammarObject):
    def __init__(self, compiler: GrammarCompiler, key: str, text: str):
        super().__init__()
        self.compiler, self.key, self.text = compiler, key, text
        self.row: RowGrammar = compiler.row(key, text)

    def accept_token(self, token: int) -> None:
        if self.finished:
            return
        if token in self.compiler.eos_ids and self.row.matcher.is_accepting():
            self.finished = True
            return
        try:
            self.row.accept(token)
        except GrammarError as exc:
            raise ValueError(str(exc)) from None

    def rollback(self, k: int) -> None:
        if k > 0 and self.finished:
            self.finished, k = False, k - 1  # the stop token was never fed to the matcher
        if k > 0:
            self.row.matcher.rollback(k)

    def is_terminated(self) -> bool:
        return self.finished

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # all allowed

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.row.fill(vocab_mask, idx)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        logits.masked_fill_(banned_tokens(vocab_mask, logits.shape[-1]).to(logits.device), float("-inf"))

    def copy(self) -> "FinalGrammar":
        return FinalGrammar(self.compiler, self.key, self.text)

    def try_jump_forward(self, tokenizer: Any) -> None:
        return None


class FinalGrammarBackend(BaseGrammarBackend):
    def __init__(self, server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Any = None):
        super().__init__()
        eos = set(eos_token_ids or ()) or {tokenizer.eos_token_id}
        self.compiler = GrammarCompiler(server_args.tokenizer_path or server_args.model_path, vocab_size, eos)

    def _compile(self, sglang_key: str, text: str) -> BaseGrammarObject:
        try:
            return FinalGrammar(self.compiler, KEYS[sglang_key], text)
        except SamplingError as exc:
            return InvalidGrammarObject(str(exc))

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self._compile("json", key_string)

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self._compile("regex", key_string)

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self._compile("ebnf", key_string)

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self._compile("structural_tag", key_string)


def register() -> None:
    register_grammar_backend(NAME, FinalGrammarBackend)
