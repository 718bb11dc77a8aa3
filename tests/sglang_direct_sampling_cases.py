"""The verl09 lane's half of tests/test_sglang_sampling.py: each sampling key SGLang 0.5.12 (veRL 0.9.1's pin)
accepts means what it means on the embedded engine - the penalties exact without the overlap scheduler,
repetition_penalty over the generated tokens, min_new_tokens holding the stop ids back - on the real engine on CPU.
Run in a process of their own by tests/test_sglang_direct.py (the stand-ins on the path from the start)."""

from __future__ import annotations

import pytest

from final import compat
from test_sglang_sampling import (  # noqa: F401 - collected here, on this module's `engines`
    engine_pair, test_min_new_tokens_stop_ids_and_stop_strings_end_rows_alike,
    test_penalties_mean_the_same_on_both_engines, test_repetition_penalty_is_applied_over_the_output_or_refused,
    test_top_k_and_min_p_keep_only_the_most_likely_token_when_tight,
    test_under_the_overlap_scheduler_penalties_are_refused_naming_why)

pytestmark = pytest.mark.skipif(compat.LANE != "verl09", reason="the verl09 lane's backend (SGLang 0.5.12); the "
                                "verl06 lane's is tests/test_sglang_sampling.py")


@pytest.fixture(scope="module")
def engines():
    yield from engine_pair()
