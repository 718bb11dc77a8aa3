"""`final serve`'s weight-update routes, in SGLang's style (its HTTP server's `/update_weights_from_disk` and
`/get_weight_version`):

  POST /update_weights_from_disk   {"model_path": DIR_OR_FILE, "keep_cartridges": false}
       -> {"success": true, "message": ..., "weights_version": N}
  GET  /get_weight_version         -> {"weight_version": N}

Off by default: a server started without `--weights-dir` answers 403, as a cartridge source it does not allow.
With it, weights are read only from under that folder (an HF model folder's *.safetensors, or one .safetensors
file; nothing pickled is executed), the path resolved first so neither `..` nor a symlink leads outside it. The
update is InferenceEngine.update_weights: checked whole before any write (400 naming the parameter), applied once
the requests in flight have finished; requests arriving meanwhile wait and run on the new weights.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from final.errors import FinalError, WeightsError
from final.server.errors import APIError, from_final


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput, the fields final serves (+ keep_cartridges, ours)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str
    load_format: str | None = None  # SGLang's; only the default ("auto") / "safetensors" here
    abort_all_requests: bool = False  # SGLang's; final always lets requests in flight finish on the old weights
    keep_cartridges: bool = False
    weight_version: str | None = None  # SGLang's label; final numbers versions itself (the response says which)


def add_weight_routes(app: FastAPI, inference, weights_dir: str | None, parse) -> None:
    """parse(raw request, body model, max bytes) -> the validated body (the app's own body reader)."""
    root = Path(weights_dir).expanduser().resolve() if weights_dir else None

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(raw: Request) -> dict:
        if root is None:
            raise APIError(403, "weight updates are disabled on this server: start `final serve` with --weights-dir "
                           "DIR to accept weights from files under DIR", code="weight_updates_disabled")
        body = await parse(raw, UpdateWeightsFromDiskRequest, inference.config.limits.max_body_bytes)
        if body.load_format not in (None, "auto", "safetensors"):
            raise APIError(400, "load_format must be auto or safetensors", param="load_format",
                           code="invalid_request")
        if body.abort_all_requests:
            raise APIError(400, "abort_all_requests is not served: requests in flight finish on the old weights "
                           "before the update", param="abort_all_requests", code="unsupported_parameter")
        path = _inside(root, body.model_path)
        try:
            version = await inference.aupdate_weights(str(path), keep_cartridges=body.keep_cartridges)
        except WeightsError as exc:
            raise APIError(400, str(exc), param="model_path" if exc.parameter is None else "weights",
                           code="invalid_weights") from exc
        except FinalError as exc:
            raise from_final(exc) from exc
        return {"success": True, "message": f"weights updated from {body.model_path}", "weights_version": version}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": inference.weights_version}


def _inside(root: Path, given: str) -> Path:
    """The file or folder `given` names (relative to root, or absolute) if it lies under root; never echoes the
    server's own paths back."""
    if "\x00" in given or not given.strip() or len(given) > 4096:
        raise APIError(400, "model_path is not a usable path", param="model_path", code="invalid_request")
    try:
        path = (root / given).resolve() if not Path(given).is_absolute() else Path(given).resolve()
    except (OSError, RuntimeError):
        raise APIError(400, "model_path cannot be resolved", param="model_path", code="invalid_request") from None
    if path != root and root not in path.parents:
        raise APIError(403, "model_path is outside the server's weights folder (--weights-dir)", param="model_path",
                       code="weights_path_refused")
    if not path.exists():
        raise APIError(400, f"no model folder or weights file at {given!r} under the weights folder",
                       param="model_path", code="invalid_request")
    return path
