"""rollout.name: tokasaurus for veRL's own trainer: seed 000's replica, generating over HTTP on a Tokasaurus server.

Importing this module registers `tokasaurus` in veRL's `RolloutReplicaRegistry` (server mode: AgentLoopManager ->
AgentLoopWorker -> AsyncLLMServerManager.generate -> our actor) and `("tokasaurus", "async")` in the worker-side
rollout registry that veRL's FSDP/Megatron workers build from in hybrid mode (`_ROLLOUT_REGISTRY`, 0.6.0 and 0.9.1). veRL imports it in every
process (driver and Ray workers) when it is named by

    VERL_USE_EXTERNAL_MODULES=final.verl_replica        (veRL 0.6.0 and 0.9.x: read by verl/__init__.py)
    the `verl.plugins` entry point in final's pyproject  (veRL >= 0.9: loaded with `import verl`, nothing to set)

or by one line in the trainer's entry point: `import final.verl_replica`.

    AsyncLLMServerManager.generate(request_id, prompt_ids, sampling_params)
      -> TokasaurusHttpServer.generate (a Ray actor, no GPU; one per replica)
      -> final.rollout.tokasaurus.TokasaurusEngine: POST token ids to /custom/cartridge/completions with
         logprobs_in_fingerprint and the configured cartridges (final/protocol/: bodies, fingerprint, retries)
      -> TokenOutput(token_ids, log_probs)

Settings (seed 000's block: tokasaurus_url, cartridges, max_retries, base_timeout, retry_delay, and ours:
cartridge_replaces_system_turn) come from
`rollout.custom` where veRL has that field (0.9.x: seed 000's config verbatim) and otherwise from
`rollout.engine_kwargs.tokasaurus` (0.6.0): engine_kwargs is 0.6.0's free-form per-backend dict (vllm: {},
sglang: {} beside it), it travels inside RolloutConfig to every replica and actor, and hydra takes it as an
override (`+actor_rollout_ref.rollout.engine_kwargs.tokasaurus.tokasaurus_url=...`). `agent.custom_async_server`
is not a settings block: it names a server class ({path, name}).

One token stream with a cartridge: veRL's agent loops render the whole chat template, so a conversation without a
system turn of its own reaches the replica as `[template's default system turn] + conversation` (SmolLM2: "You are a
helpful AI assistant named SmolLM..."), while a cartridge stands for the system turn: final's InferenceEngine,
cartridge training (final.prompts.continuation_ids) and the cartridges repo put the conversation right after it.
`cartridge_replaces_system_turn` (default true) makes the replica drop that leading default system turn
(final.prompts.default_system_ids, from veRL's tokenizer of `model.path` and `model.custom_chat_template`) before
the ids go to the server whenever cartridges are configured, so the server sees exactly continuation_ids(...).
A conversation's own system turn is kept (continuation_ids keeps it too), and so is every id of the rollout that
veRL records (`prompts` in its DataProto still start with the default system turn). false: the ids go as rendered.

The base model behind the server is frozen (only the cartridge is trained), so there are no weights to sync:
wake_up/sleep are no-ops in every mode. A cartridge being trained is rewritten at the same path between steps
and sent with `force_redownload: true`; the server reloads it only when the file changed (final/cartridges).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlsplit

import ray
from omegaconf import DictConfig, OmegaConf
from verl.single_controller.ray import RayClassWithInitArgs
from verl.workers.rollout import base as worker_rollouts
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from final.errors import CartridgeError, ConfigError, UnsupportedError

if TYPE_CHECKING:
    from final.rollout.tokasaurus import TokasaurusSettings

logger = logging.getLogger(__name__)

NAME = "tokasaurus"
LOCAL_NAME = "final"  # the embedded engine as veRL's in-process (hybrid) rollout
SYSTEM_TURN = "cartridge_replaces_system_turn"  # the replica's own key in seed 000's block (see above)
# veRL 0.9's TokenOutput adds stop_reason ('completed' | 'aborted'); 0.6.0's has only ids and logprobs
_STOP_REASON = {"stop": "completed", "length": "completed", "abort": "aborted"}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _settings_block(config: Any) -> tuple[dict, str]:
    """Seed 000's block from a RolloutConfig and its key path: `custom` (veRL >= 0.9) or `engine_kwargs.tokasaurus`
    (0.6.0). Raises ConfigError naming the key when the block is not a mapping or both are set."""
    custom = _plain(config.custom) if "custom" in type(config).__dataclass_fields__ else None
    engine = _plain((_plain(config.engine_kwargs) or {}).get(NAME))
    if custom and engine:
        raise ConfigError("set the tokasaurus settings in one place, rollout.custom or "
                          "rollout.engine_kwargs.tokasaurus, not both", key="rollout.custom")
    where = "rollout.custom" if custom else f"rollout.engine_kwargs.{NAME}"
    block = custom or engine or {}
    if not isinstance(block, dict):
        raise ConfigError(f"must be a mapping of tokasaurus_url, cartridges, ..., got {type(block).__name__}",
                          key=where)
    return block, where


def replica_settings(config: Any) -> "TokasaurusSettings":
    """Seed 000's settings from a RolloutConfig (ConfigError naming the key when a value is wrong)."""
    # final's rollout code loads on first use, not at import: `import verl` itself imports this module (the hook)
    from final.rollout.tokasaurus import TokasaurusSettings

    block, where = _settings_block(config)
    return TokasaurusSettings.from_custom(block, where=where, also=(SYSTEM_TURN,))


def system_turn_ids(config: Any, model_config: Any, settings: "TokasaurusSettings") -> list[int]:
    """The leading ids the replica drops before the server sees a prompt: the chat template's default system turn
    when cartridges are configured and cartridge_replaces_system_turn is true (its default), else none."""
    block, where = _settings_block(config)
    replaces = block.get(SYSTEM_TURN, True)
    if not isinstance(replaces, bool):
        raise ConfigError(f"must be true or false, got {replaces!r}", key=f"{where}.{SYSTEM_TURN}")
    if not replaces or not settings.cartridges:
        return []
    from verl.utils import hf_tokenizer
    from verl.utils.fs import copy_to_local

    from final.prompts import default_system_ids

    # the tokenizer and template veRL's AgentLoopWorker renders prompts with
    tokenizer = hf_tokenizer(copy_to_local(model_config.path), trust_remote_code=model_config.trust_remote_code)
    if model_config.custom_chat_template is not None:
        tokenizer.chat_template = model_config.custom_chat_template
    try:
        return default_system_ids(tokenizer)
    except CartridgeError as exc:
        raise ConfigError(f"{exc}: set it to false to send prompts as veRL renders them",
                          key=f"{where}.{SYSTEM_TURN}") from exc


@ray.remote(num_cpus=0, num_gpus=0)  # it waits on HTTP: holding a CPU would starve veRL's workers on a small node
class TokasaurusHttpServer:
    """Seed 000's TokasaurusHttpServer: veRL's token-in-token-out server handle, over HTTP to Tokasaurus (or
    `final serve`). The HTTP client runs on its own loop thread (TokasaurusEngine), so generate calls overlap."""

    def __init__(self, config: Any, settings: "TokasaurusSettings", rollout_mode: RolloutMode, replica_rank: int,
                 system_turn: tuple[int, ...] = ()):
        from final.rollout.tokasaurus import TokasaurusEngine

        self.config = config
        self.system_turn = list(system_turn)  # dropped from the front of each prompt (cartridge_replaces_system_turn)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        # like veRL's SGLang server: the longest sequence is prompt_length + response_length
        self.max_model_len = config.max_model_len or config.prompt_length + config.response_length
        self.engine = TokasaurusEngine(settings, max_connections=config.max_num_seqs, need_logprobs=False)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, **multimodal: Any) -> TokenOutput:
        """The call AsyncLLMServerManager makes (veRL 0.9 adds video_data and friends, None for text)."""
        given = sorted(k for k, v in {"image_data": image_data, **multimodal}.items() if v is not None)
        if given:
            raise UnsupportedError(NAME, given[0], "Tokasaurus' completions endpoint takes token ids only")
        from final.prompts import after_system_turn

        prompt_ids = after_system_turn(prompt_ids, self.system_turn)
        params = dict(sampling_params)
        want_logprobs = bool(params.pop("logprobs", False))
        params["max_new_tokens"] = min(self.config.response_length, self.max_model_len - len(prompt_ids) - 1)
        out = await self.engine.async_generate(input_ids=list(prompt_ids), sampling_params=params,
                                               return_logprob=want_logprobs)
        return token_output(out, want_logprobs)

    async def wake_up(self) -> None:
        logger.debug("tokasaurus replica %d: wake_up is a no-op (%s; the server owns its memory, the base model "
                     "is frozen: nothing to sync)", self.replica_rank, self.rollout_mode)

    async def sleep(self) -> None:
        logger.debug("tokasaurus replica %d: sleep is a no-op (%s; the server owns its memory)", self.replica_rank,
                     self.rollout_mode)

    # veRL 0.9's checkpoint-engine manager brackets each weight sync with these. The served base model never
    # changes, so requests in flight may finish as they are and there is no KV cache of ours to free or restore.
    async def abort_all_requests(self, reject_request: bool = False) -> None:
        logger.debug("tokasaurus replica %d: no weight sync, in-flight requests keep running", self.replica_rank)

    async def resume_generation(self) -> None:
        logger.debug("tokasaurus replica %d: resume_generation is a no-op", self.replica_rank)

    async def clear_kv_cache(self) -> None:
        logger.debug("tokasaurus replica %d: the server owns its KV cache", self.replica_rank)

    release_kv_cache = resume_kv_cache = clear_kv_cache

    def shutdown(self) -> None:
        self.engine.shutdown()


def token_output(out: dict, with_logprobs: bool) -> TokenOutput:
    """The engine dialect's result (final/rollout/tokasaurus.py sglang_output) -> veRL's TokenOutput."""
    ids = list(out["output_ids"])
    extra: dict[str, Any] = {}
    if "stop_reason" in TokenOutput.model_fields:
        extra["stop_reason"] = _STOP_REASON.get(out["meta_info"]["finish_reason"].get("type"))
    logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] if with_logprobs else None
    return TokenOutput(token_ids=ids, log_probs=logprobs, **extra)


class TokasaurusReplica(RolloutReplica):
    """One TokasaurusHttpServer actor per replica, in every mode: it needs no GPU and no rollout workers of its
    own, so standalone mode makes no resource pool (veRL's default asks Ray for GPUs) and colocated/hybrid modes
    place nothing in the trainer's pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = replica_settings(self.config)  # a wrong key fails here, in the driver, before any actor
        self.system_turn = system_turn_ids(self.config, self.model_config, self.settings)

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        return RayClassWithInitArgs(cls=TokasaurusHttpServer, config=self.config, settings=self.settings,
                                    rollout_mode=self.rollout_mode, replica_rank=self.replica_rank,
                                    system_turn=tuple(self.system_turn))

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_colocated(self, resource_pool: Any) -> None:
        self.rollout_mode = RolloutMode.COLOCATED
        self.resource_pool = resource_pool
        await self.launch_servers()

    async def launch_servers(self) -> None:
        spec = self.get_ray_class_with_init_args()
        server = spec.cls.remote(*spec.args, **spec.kwargs)
        self.servers = [server]
        self._server_handle = server
        # veRL's chat-completions clients (main_generation_server) post to http://{address}/v1/chat/completions
        self._server_address = urlsplit(self.settings.url).netloc


class TokasaurusWorkerRollout(worker_rollouts.BaseRollout):
    """The worker side of hybrid mode: veRL's FSDP/Megatron workers build `(rollout.name, "async")` from
    `_ROLLOUT_REGISTRY` and call resume/update_weights/release around each rollout (0.9: its "naive" sync). The base model behind
    the Tokasaurus server is frozen, so none of them has anything to do."""

    async def resume(self, tags: list[str]) -> None:
        logger.debug("tokasaurus worker rollout: resume(%s) is a no-op", tags)

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        logger.debug("tokasaurus worker rollout: the served base model is frozen; actor weights are not sent")

    async def release(self) -> None:
        logger.debug("tokasaurus worker rollout: release is a no-op")


def _load_replica() -> type[RolloutReplica]:
    return TokasaurusReplica


RolloutReplicaRegistry.register(NAME, _load_replica)
# a private dict of veRL's (0.6.0 and 0.9.1 alike): a later veRL without it simply gets no hybrid worker side
_workers = vars(worker_rollouts).get("_ROLLOUT_REGISTRY")
if _workers is not None:
    _workers[(NAME, "async")] = f"{__name__}.TokasaurusWorkerRollout"
    # veRL 0.6.0's hybrid engine in sync mode (`rollout.name: final, mode: sync`): its FSDP worker builds final's
    # embedded engine in-process and syncs the actor's weights into it every step (resume(["weights"]),
    # update_weights(HF-named tensors), resume(["kv_cache"]), then release() for training)
    _workers[(LOCAL_NAME, "sync")] = "final.rollout.local.LocalRollout"
