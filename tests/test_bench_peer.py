"""`final bench`'s llama.cpp peer section, on the path every machine takes: without llama-cpp-python (the `bench`
extra, never in CI) it says it was skipped and how to install it. The measuring path needs llama.cpp and a real
model; it is exercised by the run recorded in bench/RESULTS.md. The F32 GGUF that gives llama.cpp the engine's
weights is checked here on a small GGUF written with the `gguf` package."""

from __future__ import annotations

import json
import sys

import gguf
import numpy as np

from final.bench import cli
from final.bench.peer import INSTALL, agreement, describe, f32_gguf, run_peer


def test_without_llama_cpp_the_peer_is_skipped_with_install_hint(monkeypatch, capsys, tiny_dir):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError, as when not installed
    res = run_peer("builtin:smollm2-135m-instruct", tiny_dir, [1], 4, 1)
    assert "not importable" in res["peer"]["skipped"] and res["peer"]["install"] == INSTALL
    assert "final[bench]" in INSTALL
    assert cli.main(["--quick", "--json", "--only", "peer", "--in-process"]) == 0  # where the monkeypatch holds
    out = json.loads(capsys.readouterr().out)
    assert out["peer"] == res["peer"]
    assert isinstance(out["machine"]["cpu_flags"], list)
    assert any("install: " in line for line in describe(out["peer"]))


def test_peer_needs_a_gguf_and_a_cpu(tiny_dir):
    assert "CPU only" in run_peer("builtin:tiny-random-llama", tiny_dir, [1], 4, 1, device="cuda")["peer"]["skipped"]
    try:
        import llama_cpp  # noqa: F401 - only where the bench extra is installed
    except ImportError:
        return
    assert "has no GGUF" in run_peer("builtin:tiny-random-llama", tiny_dir, [1], 4, 1)["peer"]["skipped"]


def test_f32_gguf_dequantizes_every_tensor_and_keeps_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("FINAL_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    src = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(128)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = f32_gguf(src)
    assert out.parent == tmp_path / "cache" / "gguf" and f32_gguf(src) == out  # built once
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(4, 64), want)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    assert reader.fields["llama.context_length"].contents() == 128
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]


def test_agreement_counts_identical_rows_and_common_prefix():
    a = agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert a["rows_identical"] == "1/2" and a["mean_common_prefix"] == 2.0


def test_step_bytes_counts_every_matrix_a_decode_step_reads_once(tiny_dir):
    """The roofline's bytes: each layer's matrices and the lm_head (the embedding a step reads one row of is not
    counted again), as the HF model holds them in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from final.bench.peer import step_bytes
    from final.engine import EmbeddedEngine

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    want = hf.get_output_embeddings().weight.numel() + sum(
        p.numel() for name, p in hf.named_parameters() if p.dim() == 2 and ".layers." in name)
    engine = EmbeddedEngine(tiny_dir, dtype="float32")
    try:
        assert engine.call(lambda _r: step_bytes(engine.model)) == 4 * want
    finally:
        engine.shutdown()


def test_the_decode_roofline_line_compares_both_sides_streamed_rates():
    row = {"mode": "fp32", "batch": 1, "ours_tok_s": 35.8, "llama_cpp_tok_s": 26.9, "llama_cpp_decode_tok_s": 28.7,
           "ours_decode_tok_s": 38.2, "ratio": 1.33, "agreement": {"rows_identical": "1/1", "mean_common_prefix": 64},
           "roofline": {"weight_mb_per_step": 513.0, "ours_gb_s": 20.56, "llama_cpp_gb_s": 15.46, "sum_gb_s": 20.68}}
    lines = describe({"engine": "llama.cpp", "threads": 2, "new_tokens": 64, "batched": "-", "timing": "-",
                      "rows": [row]})
    line = next(x for x in lines if "decode steps only" in x)
    assert "ours 38.2 tok/s, llama.cpp 28.7" in line and "llama.cpp 15.46 GB/s (75% of ours)" in line
    assert "sum reads 20.68 GB/s" in line
