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

Settings (seed 000's block: tokasaurus_url, cartridges, max_retries, base_timeout, retry_delay) come from
`rollout.custom` where veRL has that field (0.9.x: seed 000's config verbatim) and otherwise from
`rollout.engine_kwargs.tokasaurus` (0.6.0): engine_kwargs is 0.6.0's free-form per-backend dict (vllm: {},
sglang: {} beside it), it travels inside RolloutConfig to every replica and actor, and hydra takes it as an
override (`+actor_rollout_ref.rollout.engine_kwargs.tokasaurus.tokasaurus_url=...`). `agent.custom_async_server`
is not a settings block: it names a server class ({path, name}).

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

from final.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from final.rollout.tokasaurus import TokasaurusSettings

logger = logging.getLogger(__name__)

NAME = "tokasaurus"
# veRL 0.9's TokenOutput adds stop_reason ('completed' | 'aborted'); 0.6.0's has only ids and logprobs
_STOP_REASON = {"stop": "completed", "length": "completed", "abort": "aborted"}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def replica_settings(config: Any) -> "TokasaurusSettings":
    """Seed 000's settings from a RolloutConfig: `custom` (veRL >= 0.9) or `engine_kwargs.tokasaurus` (0.6.0).

    Raises ConfigError naming the key when the block is not a mapping, both are set, or a value is wrong."""
    # final's rollout code loads on first use, not at import: `import verl` itself imports this module (the hook)
    from final.rollout.tokasaurus import TokasaurusSettings

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
    return TokasaurusSettings.from_custom(block, where=where)


@ray.remote(num_cpus=0, num_gpus=0)  # it waits on HTTP: holding a CPU would starve veRL's workers on a small node
class TokasaurusHttpServer:
    """Seed 000's TokasaurusHttpServer: veRL's token-in-token-out server handle, over HTTP to Tokasaurus (or
    `final serve`). The HTTP client runs on its own loop thread (TokasaurusEngine), so generate calls overlap."""

    def __init__(self, config: Any, settings: "TokasaurusSettings", rollout_mode: RolloutMode, replica_rank: int):
        from final.rollout.tokasaurus import TokasaurusEngine

        self.config = config
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

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        return RayClassWithInitArgs(cls=TokasaurusHttpServer, config=self.config, settings=self.settings,
                                    rollout_mode=self.rollout_mode, replica_rank=self.replica_rank)

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
