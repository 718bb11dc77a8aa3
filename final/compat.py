"""The two veRL lanes (docs/concepts/backends-and-lanes.md), and every place where final's code depends on which
one it runs on.

- `verl06`: veRL 0.6.0 + transformers 4 + numpy 1, the design card's lane (the only veRL with the in-process
  SGLangRollout that the `sglang` backend builds).
- `verl09`: veRL 0.9.1 + transformers 5 + numpy 2 (pyproject extra `verl09`, `FINAL_LANE=verl09 scripts/install.sh`).

What differs between them and is read here, so that no other module asks for a version:
- `apply_chat_template(tokenize=True)` returns a list in transformers 4 and a BatchEncoding in 5: `chat_ids`.
- veRL 0.9 removed `rollout.multi_turn.interaction_config_path` and added `function_tool_path`; neither is served
  by final's multi-turn loop: `MULTI_TURN_UNSERVED`.
- veRL 0.9 removed `verl.tools.gsm8k_tool` (the shipped tools.yaml's tool): `TOOL_MODULES`.
- veRL 0.9 removed `rollout.mode: sync` (its RolloutConfig raises): `ROLLOUT_MODES` / `check_mode`.
- veRL 0.9 removed the in-process SGLangRollout, and pins SGLang 0.5.12 instead of 0.5.2: `SGLANG_ROLLOUT`,
  `SGLANG_PIN`.
- veRL's standalone agent loop (AgentLoopManager without a trainer's worker group): 0.6.0's manager starts the
  rollout replicas itself, 0.9.1's takes the client of an LLMServerManager that started them, and 0.9.1 counts the
  rollout's own nodes (`rollout.nnodes`, 0 = hybrid): `standalone_agent_loop`, `STANDALONE_OVERRIDES`.
- transformers 5 dropped `default` from HF's RoPE init table (cartridge position conversion): `rope_init_functions`.
- veRL 0.9's reward loop (its NaiveRewardManager) also reports a number-valued score as `acc`, which then becomes
  the validation's core metric; 0.6.0's reports only `reward`: `REWARD_NUMBER_AS_ACC` (final eval verl).
- A model folder that transformers 4 converted from GGUF (`builtin:*`) names `LlamaTokenizer`, which transformers 5
  rebuilds as a SentencePiece-style tokenizer over SmolLM2's byte-level BPE: prompts tokenize wrong and output
  decodes as 'Ġ'/'Ċ' (measured: "The answer is:" repeated instead of "... Paris."); 5 writes `TokenizersBackend`,
  which 4 cannot load. So each transformers major converts into its own cache folder: `MODEL_CACHE`; and 5's
  conversion adds no BOS to raw text where 4's did: `GGUF_TOKENIZER_NEEDS_BOS`.
Code that reads tokenizer files takes either layout rather than asking for a version (tests/multiturn_helpers.py:
`added_tokens_decoder`, which transformers 5 no longer writes to tokenizer_config.json).

Only package metadata is read here (no veRL or transformers import), so this is cheap to import anywhere.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version

from final.errors import ConfigError


def _version(dist: str) -> Version | None:
    try:
        return Version(version(dist))
    except PackageNotFoundError:
        return None


VERL = _version("verl")
TRANSFORMERS = _version("transformers")

# The lanes pyproject.toml offers, with what each was tested with (docs/concepts/backends-and-lanes.md).
LANES = {"verl06": "veRL 0.6.0 + transformers 4.56+ (<5)", "verl09": "veRL 0.9.1 + transformers 5.5.3+ (<5.11)"}
# without veRL (the embedded engine alone: final.engine, as scripts/gpu_weights.py runs it) transformers decides
LANE = "verl09" if (VERL is not None and VERL >= Version("0.7")) or (
    VERL is None and TRANSFORMERS is not None and TRANSFORMERS.major >= 5) else "verl06"


def check_lane() -> None:
    """Refuse the one untested mix pip can build: veRL 0.6.x with transformers 5 (veRL 0.6.0 does not bound
    transformers; veRL 0.9.1 bounds it and numpy itself)."""
    if LANE == "verl06" and TRANSFORMERS is not None and TRANSFORMERS.major >= 5:
        raise ImportError(f"final: veRL {VERL} needs transformers <5, found {TRANSFORMERS}. Pick a lane: "
                          "pip install 'final[verl06]' (veRL 0.6.0, transformers 4) or 'final[verl09]' "
                          "(veRL 0.9.1, transformers 5); docs/concepts/backends-and-lanes.md.")


# veRL 0.9 removed verl/tools/gsm8k_tool.py, which final's shipped tools.yaml (and veRL 0.6.0's GSM8K recipe) name:
# tools.yaml modules resolved through this map (final.tools.gsm8k is 0.6.0's class), so one tools.yaml loads on both.
TOOL_MODULES: dict[str, str] = {} if LANE == "verl06" else {"verl.tools.gsm8k_tool": "final.tools.gsm8k"}

# $FINAL_CACHE/<MODEL_CACHE>/<name>: converted builtin models, one folder per transformers major (see above).
MODEL_CACHE = "models" if TRANSFORMERS is None or TRANSFORMERS.major < 5 else "models-transformers5"

# transformers 4 converts a GGUF tokenizer to LlamaTokenizer, which puts BOS before raw text whatever the GGUF says;
# 5 follows the GGUF (SmolLM2's: no BOS). final's builtin models keep 4's tokenization on both lanes, so a raw prompt
# is the same ids (and scores the same) on either: final.models sets add_bos_token where this is True.
GGUF_TOKENIZER_NEEDS_BOS = TRANSFORMERS is not None and TRANSFORMERS.major >= 5

# veRL's RolloutConfig.mode values on this lane: 0.9 raises on `sync` ("only async mode is supported").
ROLLOUT_MODES: tuple[str, ...] = ("sync", "async") if LANE == "verl06" else ("async",)

# The class behind `rollout.name: sglang` on this lane (final.rollout's registry). verl06: veRL 0.6.0's in-process
# SGLangRollout, subclassed, on SGLang 0.5.2. verl09: veRL 0.7 removed that class (0.9's SGLang path is a Ray actor
# serving HTTP), so SGLang 0.5.12's Engine is driven directly (final/rollout/sglang/rollout_0512.py says why).
SGLANG_ROLLOUT = ("final.rollout.sglang.rollout_052:SGLangRollout" if LANE == "verl06"
                  else "final.rollout.sglang.rollout_0512:DirectSGLangRollout")
SGLANG_PIN = "sglang==0.5.2" if LANE == "verl06" else "sglang==0.5.12"  # the SGLang this lane's veRL pins

# rollout.multi_turn fields of this lane's MultiTurnConfig that final's multi-turn loop does not serve: set to
# anything but their default, the config is refused (a documented-but-ignored setting would be silent).
MULTI_TURN_UNSERVED: tuple[str, ...] = (
    ("interaction_config_path",) if LANE == "verl06" else ("function_tool_path",))


def unserved_multi_turn(mt: Any) -> str | None:
    """The first field of MULTI_TURN_UNSERVED set in veRL's MultiTurnConfig `mt`, else None."""
    return next((name for name in MULTI_TURN_UNSERVED if getattr(mt, name, None)), None)


# veRL 0.9's reward-loop NaiveRewardManager.run_single: `reward_extra_info["acc"] = score` when the score is a
# number (not a dict); 0.6.0's NaiveRewardManager adds no extra info then. Validation metrics follow (`val-core`
# is `acc` where it exists, else `reward`).
REWARD_NUMBER_AS_ACC = LANE == "verl09"

# hydra overrides of veRL's ppo_trainer.yaml that a standalone AgentLoopManager needs on this lane
STANDALONE_OVERRIDES: tuple[str, ...] = () if LANE == "verl06" else ("actor_rollout_ref.rollout.nnodes=1",)


def standalone_agent_loop(config: Any) -> tuple[Any, list[Any]]:
    """veRL's AgentLoopManager in standalone mode over the trainer config `config` (with STANDALONE_OVERRIDES),
    built as this lane's trainer builds it, and the rollout replicas it generates through (whose `servers` are
    the Ray actors behind them)."""
    from verl.experimental.agent_loop import AgentLoopManager

    if LANE == "verl06":
        manager = AgentLoopManager(config)
        return manager, list(manager.rollout_replicas)
    from verl.workers.rollout.llm_server import LLMServerManager

    servers = LLMServerManager.create(config)
    return AgentLoopManager.create(config, servers.get_client()), list(servers.get_replicas())


def rope_init_functions() -> dict:
    """HF's RoPE inits by rope_type (transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS). transformers 5 dropped
    `default` from that table (each model class computes it); it is added back here with HF's formula, so a
    `from_zero` cartridge converts the same on both lanes."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if "default" in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS
    return {**ROPE_INIT_FUNCTIONS, "default": _default_rope}


def _default_rope(config: Any, device: Any) -> tuple[Any, float]:
    import torch

    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)), 1.0


def check_mode(mode: Any, path: str | None = None) -> None:
    """A ConfigError for a `rollout.mode` this lane's veRL does not have."""
    if mode not in ROLLOUT_MODES:
        raise ConfigError(f"must be {' or '.join(map(repr, ROLLOUT_MODES))} on the {LANE} lane, got {mode!r}",
                          key="rollout.mode", path=path)


def chat_ids(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    """`tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)` as a list of token ids on either
    transformers (5 returns a BatchEncoding by default; `return_dict=False` asks both for the plain list)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return [int(i) for i in ids]
