"""The weight-update request of SGLang's HTTP server, as `final serve` answers it (final/server/weights.py) and as
both clients send it (the tokasaurus backend's update_weights, final.client's TokasaurusClient)."""

from __future__ import annotations

from final.errors import EngineError, FinalError, WeightsError
from final.protocol.http import RequestRejectedError

UPDATE_PATH = "/update_weights_from_disk"
VERSION_PATH = "/get_weight_version"


def update_body(model_path: str, keep_cartridges: bool = False) -> dict:
    return {"model_path": str(model_path), "keep_cartridges": bool(keep_cartridges)}


def update_result(data: dict) -> int:
    """The server's answer -> its new weights version (SGLang's own server answers success without one: -1)."""
    if not isinstance(data, dict) or not data.get("success"):
        raise EngineError(f"the server did not update its weights: {str(data)[:300]}")
    version = data.get("weights_version")
    return int(version) if isinstance(version, int) else -1


def rejected(exc: RequestRejectedError) -> FinalError:
    """A 4xx answer to an update as the typed error the caller would get in-process: a refused update names the
    parameter (WeightsError); the rest (updates disabled: 403, a path outside the server's folder) stay as sent."""
    if exc.code == "invalid_weights":
        return WeightsError(f"the server refused the update: {exc}")
    return exc
