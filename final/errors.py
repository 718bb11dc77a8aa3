"""Typed errors. Every error names its cause (a config key path, a file and field, a request field)
so a user can fix the input without reading a traceback; the engine keeps serving afterwards."""

from __future__ import annotations


class FinalError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigError(FinalError, ValueError):
    """A config file or dict is wrong. `key` is the dotted path of the offending key."""

    def __init__(self, message: str, key: str | None = None, path: str | None = None):
        self.key = key
        self.path = path
        where = []
        if path:
            where.append(str(path))
        if key:
            where.append(f"key '{key}'")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class ToolConfigError(ConfigError):
    """tools.yaml (or multi_turn settings) is wrong."""


class DataError(FinalError, ValueError):
    """An evaluation data file is wrong (a veRL parquet: a missing column, a malformed row, a data source nothing
    scores). `path` names the file, `row` the row (0-based, in that file), `column` the column or nested key
    (`reward_model.ground_truth`, `extra_info.tools_kwargs.<tool>`)."""

    def __init__(self, message: str, path: str | None = None, row: int | None = None, column: str | None = None):
        self.path = path
        self.row = row
        self.column = column
        where = [str(path)] if path else []
        if row is not None:
            where.append(f"row {row}")
        if column:
            where.append(f"column '{column}'")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class ModelError(FinalError, ValueError):
    """The model cannot be resolved or loaded (missing path, unsupported architecture, missing package)."""


class BackendUnavailableError(FinalError, RuntimeError):
    """The chosen rollout backend cannot run here (no CUDA, missing extra). The message says how to fix it."""


class PromptError(FinalError, ValueError):
    """A prompt is malformed (empty, bad message, too long). `index` is the prompt's position in the batch."""

    def __init__(self, message: str, index: int | None = None):
        self.index = index
        super().__init__(f"prompt {index}: {message}" if index is not None else message)


class SamplingError(FinalError, ValueError):
    """A sampling parameter is out of range. `field` names it."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.reason = message  # without the field's name, for errors that name it their own way (a config key)
        super().__init__(f"sampling parameter '{field}': {message}" if field else message)


class ToolsError(SamplingError):
    """A call's tools, tool_choice, parallel_tool_calls, response_format, chat_template_kwargs or max_turns cannot be
    served as given. `field` names it as the request sent it (`tools[1].function.parameters`, `tool_choice`,
    `response_format.json_schema.schema`); HTTP 400 with that `param`."""

    def __init__(self, message: str, field: str):
        self.field = field
        self.reason = message
        ValueError.__init__(self, f"'{field}': {message}")


class CartridgeError(FinalError, ValueError):
    """A cartridge file, manifest or request is wrong. `file` and `field` name the cause."""

    def __init__(self, message: str, file: str | None = None, field: str | None = None):
        self.file = file
        self.field = field
        where = []
        if file:
            where.append(f"cartridge {file}")
        if field:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class CartridgeSourceError(CartridgeError):
    """A cartridge's source refused or failed: `reason` is "disabled" (the server does not allow that source:
    HTTP 403), "unreachable" (the download failed: 502) or "timeout" (no file within limits.cartridge_fetch_s:
    504). `file` is the cartridge id, `source` its source."""

    def __init__(self, message: str, file: str | None = None, source: str | None = None,
                 reason: str = "unreachable"):
        self.source = source
        self.reason = reason
        super().__init__(f"source {source}: {message}" if source else message, file=file, field="source")


class EngineError(FinalError, RuntimeError):
    """The engine cannot serve a request (shut down, internal failure)."""


class SequenceError(EngineError):
    """The engine aborted a request's sequence (row) while serving it: its logits were not finite, sampling or
    finishing it failed, or its engine step failed. Only that request fails; the engine keeps serving. `row` is
    the row's index in the request (None: every row of the step), `cause` what the engine reported."""

    def __init__(self, cause: str, row: int | None = None):
        self.cause = cause
        self.row = row
        super().__init__(f"row {row} was aborted by the engine: {cause}" if row is not None else cause)


class OverloadedError(EngineError):
    """Admission control: running this request now would queue more rows than limits.max_queued_rows. Nothing
    has run; retry after `retry_after` seconds (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        self.retry_after = retry_after
        super().__init__(message)


class DeadlineError(EngineError):
    """The request ran past its deadline (limits.deadline_s); its rows were aborted (HTTP 504)."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        super().__init__(f"the request ran past its deadline of {deadline_s:g} s (limits.deadline_s); its rows were "
                         "aborted")


class UnsupportedError(SamplingError):
    """The chosen backend cannot serve what a request asks for (a capability it lacks). Raised before any work;
    `backend` and `field` name the cause (a sampling key, or `cartridge` / `tools_kwargs`)."""

    def __init__(self, backend: str, field: str, message: str | None = None):
        self.backend = backend
        self.field = field
        ValueError.__init__(self, f"'{field}': {message or f'not supported by the {backend} backend'}")


class ReplicaError(EngineError):
    """Replicas of a final.pool pool died (or never started) and no replica is left to run the work.
    `replicas` maps each dead replica's index to why it died (Ray's reason: killed, crashed, out of memory)."""

    def __init__(self, message: str, replicas: dict[int, str] | None = None):
        self.replicas = dict(replicas or {})
        why = "; ".join(f"replica {i}: {reason}" for i, reason in sorted(self.replicas.items()))
        super().__init__(f"{message} ({why})" if why else message)


class AdapterError(FinalError, ValueError):
    """A LoRA adapter cannot be served: a folder without a PEFT adapter in it, a config it cannot apply (DoRA,
    biases, an embedding target...), or a name no loaded adapter has. `field` names the config key or the request
    field (`adapter`, `model`), `path` the adapter's folder. A wrong tensor is a WeightsError naming the tensor."""

    def __init__(self, message: str, field: str | None = None, path: str | None = None):
        self.field = field
        self.path = path
        where = [f"adapter {path}"] if path else []
        if field:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class WeightsError(FinalError, ValueError):
    """A weight update is wrong: an unknown parameter name, a wrong shape or dtype, a NaN/Inf, an unreadable
    file. `parameter` names the offending parameter (None: the update as a whole). Raised before any tensor is
    written: the engine keeps serving its old weights, unchanged."""

    def __init__(self, message: str, parameter: str | None = None):
        self.parameter = parameter
        super().__init__(f"parameter '{parameter}': {message}" if parameter else message)
