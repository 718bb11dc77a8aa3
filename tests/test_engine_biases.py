"""Llama checkpoints with biases (attention_bias: q, k, v and o_proj; mlp_bias: gate, up and down_proj) on every path
of the embedded engine, against HF's forward with the same weights; and a parameter the loader would drop is an
error naming it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from final.engine import EmbeddedEngine, kernels
from final.engine.kernels import dequantize, quantize
from final.errors import ModelError

PROMPTS = [[1, 5, 9, 30, 31, 7, 8, 2, 40, 41, 42], [1, 17]]  # a prefill over 8 rows (oneDNN / torch) and a short one


@pytest.fixture(scope="module")
def biased_dir(tmp_path_factory, tiny_dir) -> str:
    """tiny-random-llama's shapes with attention_bias and mlp_bias, every weight and bias random (biases large
    enough that dropping one changes the log-probs by far more than the tolerances below)."""
    out = tmp_path_factory.mktemp("biased-llama")
    config = AutoConfig.from_pretrained(tiny_dir)
    config.attention_bias, config.mlp_bias, config.tie_word_embeddings = True, True, False
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif p.dim() > 1:
                p.normal_(0.0, 0.35)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    return str(out)


def hf_reference(path: str, quantization: str | None):
    """HF's model with each matrix as the engine holds it (bf16-rounded, or int8 with a scale per 32 dequantized);
    biases, norms and the embedding fp32 as the engine keeps them."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and quantization == "bf16":
                module.weight.copy_(module.weight.bfloat16().float())
            elif isinstance(module, torch.nn.Linear) and quantization == "int8":
                module.weight.copy_(dequantize(*quantize(module.weight)))
    return hf


def engine_logprobs(path: str, quantization: str | None) -> list[tuple[list[int], list[float], list[float]]]:
    """Each prompt's greedy tokens, their log-probs (decode steps) and the prompt's own log-probs (prefill)."""
    engine = EmbeddedEngine(path, max_model_len=64, quantization=quantization)
    try:
        if quantization is None and kernels.gemv_kernel() is not None:
            assert engine.model.kernel is not None  # the kernel's whole-step decode carries the biases too
        outs = engine.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                               return_logprob=True, logprob_start_len=0)
    finally:
        engine.shutdown()
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
             [lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) for o in outs]


def hf_logprobs(hf, prompt: list[int], ids: list[int]) -> tuple[list[float], list[float]]:
    full = prompt + ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    lps = [ref[j - 1, full[j]].item() for j in range(1, len(full))]
    return lps[len(prompt) - 1:], lps[: len(prompt) - 1]


@pytest.mark.parametrize("gemv,quantization,tol", [
    ("0", None, 1e-4),  # torch's kernels
    ("1", None, 1e-4),  # the C kernel: fused products, the whole decode step
    ("1", "bf16", 1e-3),
    ("1", "int8", 1e-2),  # the int16 activations (~1e-5 of each block) over 2 layers
])
def test_biases_are_loaded_on_every_path(biased_dir, monkeypatch, gemv, quantization, tol):
    monkeypatch.setenv("FINAL_GEMV", gemv)
    if quantization == "int8" and kernels.gemv_kernel() is None:
        pytest.skip("int8 runs on the engine's kernel only")
    hf = hf_reference(biased_dir, quantization)
    for prompt, (ids, decode_lps, prompt_lps) in zip(PROMPTS, engine_logprobs(biased_dir, quantization)):
        want_decode, want_prompt = hf_logprobs(hf, prompt, ids)
        assert max(abs(a - b) for a, b in zip(decode_lps, want_decode)) < tol
        assert max(abs(a - b) for a, b in zip(prompt_lps, want_prompt)) < tol
    # the biases matter at these tolerances: HF without them is far off
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith((".o_proj.bias", ".down_proj.bias")):
                p.zero_()
    off, _ = hf_logprobs(hf, PROMPTS[0], ids)
    assert max(abs(a - b) for a, b in zip(off, want_decode)) > 100 * tol


def test_a_bias_update_reaches_every_matrix(biased_dir):
    """A weight update names o_proj's and the MLP's biases (parameter_shapes lists them) and lands in place."""
    from final.engine.weights import parameter_shapes

    engine = EmbeddedEngine(biased_dir, max_model_len=64)
    try:
        model = engine.model
        shapes = parameter_shapes(model)
        names = ["model.layers.1.self_attn.o_proj.bias", "model.layers.1.mlp.up_proj.bias",
                 "model.layers.1.mlp.down_proj.bias"]
        assert [shapes[n] for n in names] == [(64,), (128,), (64,)]
        engine.update_weights([(n, torch.full(shapes[n], 0.25)) for n in names])
        layer = model.layers[1]
        assert bool((layer.wo.bias == 0.25).all()) and bool((layer.w_down.bias == 0.25).all())
        assert bool((layer.w_gate_up.bias[128:] == 0.25).all()) and not bool((layer.w_gate_up.bias[:128] == 0.25).all())
    finally:
        engine.shutdown()


def test_a_parameter_the_loader_does_not_hold_is_an_error_naming_it(biased_dir, monkeypatch):
    """Every HF parameter must land somewhere: one the engine's layout has no place for is refused, by name."""
    from final.engine import model as model_mod
    from final.engine.model import CausalLM

    real = model_mod.parameter_shapes

    def without_down_bias(model):
        shapes = real(model)
        del shapes["model.layers.0.mlp.down_proj.bias"]
        return shapes

    monkeypatch.setattr(model_mod, "parameter_shapes", without_down_bias)
    with pytest.raises(ModelError, match=r"model\.layers\.0\.mlp\.down_proj\.bias"):
        CausalLM.from_pretrained(biased_dir, torch.float32)
