"""The verl09 lane's weight updates into the real SGLang 0.5.12 on CPU (update_weights_from_tensor): the cases of
tests/test_weight_sync_sglang.py, run in a process of their own by tests/test_sglang_direct.py (see
sglang_direct_cases.py for why), on one engine of their own."""

from __future__ import annotations

import pytest

from final import compat
from test_weight_sync_sglang import sglang_engine

pytestmark = pytest.mark.skipif(compat.LANE != "verl09", reason="the verl09 lane's backend (SGLang 0.5.12); the "
                                "verl06 lane runs tests/test_weight_sync_sglang.py")

from test_weight_sync_sglang import (  # noqa: E402,F401
    test_a_bad_update_reaches_sglang_not_at_all, test_a_trainers_adapter_is_merged_and_sent_as_weights,
    test_cartridges_are_unloaded_by_an_update_unless_kept, test_full_and_partial_updates_answer_as_hf_generate,
    test_release_and_resume_then_serve)


@pytest.fixture(scope="module")
def engine():
    with sglang_engine() as eng:
        yield eng
