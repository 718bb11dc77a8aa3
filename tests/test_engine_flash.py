"""flash-attn on CUDA (extra [gpu]): the embedded engine's flash path against its own SDPA path.

Runs only where a CUDA device and flash_attn exist (GPU CI); elsewhere the engine never selects flash-attn,
which the last test checks on every machine.
"""

from __future__ import annotations

import pytest
import torch

from final.engine.attention import flash_attn_for

needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or flash_attn_for(torch.device("cuda"), torch.bfloat16) is None,
    reason="needs a CUDA device and flash_attn (pip install -e '.[gpu]')")


@needs_flash
def test_flash_and_sdpa_paths_agree_on_cuda(tiny_dir):
    from final.engine import EmbeddedEngine

    engine = EmbeddedEngine(tiny_dir, dtype="bfloat16", device="cuda")
    try:
        assert engine.runner.flash is not None
        prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1] + list(range(20, 60))]
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        flash_out = engine.generate(prompts, params, return_logprob=True)
        engine.call(lambda runner: setattr(runner, "flash", None))
        sdpa_out = engine.generate(prompts, params, return_logprob=True)
        for a, b in zip(flash_out, sdpa_out):
            la = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
            lb = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
            # bf16 kernels round differently; the first token's logprob must agree closely, tokens mostly
            assert abs(la[0] - lb[0]) < 5e-2
            assert sum(x == y for x, y in zip(a["output_ids"], b["output_ids"])) >= len(a["output_ids"]) // 2
    finally:
        engine.shutdown()


def test_flash_is_never_selected_off_cuda_or_in_fp32():
    assert flash_attn_for(torch.device("cpu"), torch.bfloat16) is None
    assert flash_attn_for(torch.device("cuda"), torch.float32) is None
