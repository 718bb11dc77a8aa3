"""The FastAPI app of `final serve`: Tokasaurus' endpoints on one InferenceEngine.

Endpoints, as in ScalingIntelligence/tokasaurus (branch geoff/cartridges) tokasaurus/server/endpoints.py:
  GET  /ping                              {"message": "pong"}
  GET  /v1/models
  POST /v1/completions, /v1/chat/completions                          OpenAI (stream: SSE)
  POST /custom/cartridge/completions, /custom/cartridge/chat/completions
       the same bodies + cartridges: [{id, source, force_redownload}]; on every chat route, <cartridge>{...}
       </cartridge> blocks in a system message name cartridges too (prepare.system_cartridges)
       (also under /v1/cartridge/..., the names older Tokasaurus branches and clients use)
  POST /generate                          seed 001's native `protocol: toka` body (not in real Tokasaurus)
  GET  /custom/cartridges                 loaded cartridges and the references held on them (ours)
  POST /update_weights_from_disk, GET /get_weight_version   SGLang's weight-update routes (final/server/weights.py;
       403 unless the server was started with --weights-dir)
Not served: files/batches and the pickled synchronous-batch endpoints (we never send pickles).
Errors are OpenAI-style JSON (final/server/errors.py); a request's failure never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from final.errors import FinalError
from final.protocol import bodies
from final.server import prepare
from final.server.errors import APIError, Redactor, from_final, from_validation
from final.server.limits import read_body
from final.server.responses import Renderer
from final.server.streaming import sse
from final.server.weights import add_weight_routes

logger = logging.getLogger(__name__)
# path -> (body model, how to prepare it)
ROUTES = {
    "/v1/completions": (bodies.CompletionsRequest, prepare.completion_call),
    "/v1/chat/completions": (bodies.ChatCompletionRequest, prepare.chat_call),
    "/custom/cartridge/completions": (bodies.CartridgeCompletionsRequest, prepare.completion_call),
    "/custom/cartridge/chat/completions": (bodies.CartridgeChatCompletionRequest, prepare.chat_call),
    "/v1/cartridge/completions": (bodies.CartridgeCompletionsRequest, prepare.completion_call),
    "/v1/cartridge/chat/completions": (bodies.CartridgeChatCompletionRequest, prepare.chat_call),
    "/generate": (bodies.GenerateRequest, prepare.generate_call),
}


class Service:
    """What every route does: parse the body, prepare the call (all checks), run it on the InferenceEngine,
    render the answer. A disconnecting client cancels its call, which aborts its rows."""

    def __init__(self, inference: Any, cartridge_dir: str | None, cartridge_sources: tuple[str, ...] | None = None,
                 weights_dir: str | None = None):
        self.inference = inference
        self.cartridge_dir = Path(cartridge_dir).resolve() if cartridge_dir else None
        # every error body goes through it: no absolute path of this server's disk reaches a client
        self.redact = Redactor.for_server(cartridge_dir, weights_dir, inference.config.model_path)
        # which sources requests may name (remote ones download with the server's credentials)
        self.cartridge_sources = tuple(cartridge_sources or inference.config.cartridge_sources)
        self.renderer = Renderer(inference.tokenizer)
        self.model_id = inference.config.model_path
        self.max_body_bytes = inference.config.limits.max_body_bytes

    async def handle(self, raw: Request, model: type[BaseModel], make_call: Any) -> Any:
        body = await _parse(raw, model, self.max_body_bytes)
        param = "messages" if make_call is prepare.chat_call else "prompt"
        try:
            loaded = self.inference.cartridge_ids()
            body = prepare.system_cartridges(body)  # Tokasaurus' <cartridge> blocks in a system message
            specs = prepare.cartridge_specs(body, loaded, self.cartridge_dir, self.cartridge_sources)
            call = make_call(self.inference, body, specs, self.adapter_of(body.model))
            if call.stream:
                return await self._stream(call)
            out = await _cancel_on_disconnect(raw, self.inference.arun(call.request))
        except FinalError as exc:
            raise from_final(exc, param) from exc
        if make_call is prepare.generate_call:
            return self.renderer.generate(call, out)
        return self.renderer.completion(call, out)

    def adapter_of(self, model: str | None) -> str | None:
        """The OpenAI `model` field naming a loaded LoRA adapter (as vLLM and SGLang serve them); with adapters
        loaded, any other name than the served model's is a 404, as vLLM answers it."""
        adapters = self.inference.adapter_names()
        if model in adapters:
            return model
        if adapters and model not in (None, self.model_id):
            raise APIError(404, f"The model {model!r} does not exist: this server serves {self.model_id!r} and the "
                                f"adapters {adapters}", param="model", code="model_not_found")
        return None

    async def _stream(self, call: prepare.Call) -> StreamingResponse:
        updates = self.inference.astream(call.request)
        try:  # bad input (and a backend's refusal) fails before the response starts
            first = await updates.__anext__()
        except BaseException:
            await updates.aclose()
            raise
        eos = set(self.inference.eos_token_ids) | set(call.request.sampling.params.get("stop_token_ids") or [])
        events = sse(call, _chain(first, updates), self.renderer, eos, self.redact)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(inference, api_key: str | None = None, cartridge_dir: str | None = None,
               cartridge_sources: tuple[str, ...] | None = None, weights_dir: str | None = None) -> FastAPI:
    """An app serving `inference` (an InferenceEngine, or a ReplicaPool: the same API); with api_key, every route but /ping needs the bearer key.
    Requests may load local cartridge files only from `cartridge_dir` (none: only already-loaded ids), and download
    only from `cartridge_sources` (None: the config's cartridge_sources, by default local only). Weight updates
    (final/server/weights.py) are accepted only with `weights_dir`, from files under it."""
    app = FastAPI(title="final serve", docs_url=None, redoc_url=None)
    service = Service(inference, cartridge_dir, cartridge_sources, weights_dir)
    _add_error_handlers(app, service.redact)
    if api_key:
        _add_auth(app, api_key)

    @app.get("/ping")
    async def ping() -> dict:
        return {"message": "pong"}

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model, then each loaded LoRA adapter with the model as its parent (vLLM's listing)."""
        now = int(time.time())
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": now,
                                            "owned_by": "final"}] + [
            {"id": name, "object": "model", "created": now, "owned_by": "final", "parent": service.model_id}
            for name in inference.adapter_names()]}

    @app.get("/custom/cartridges")
    async def cartridges() -> dict:
        """The loaded cartridges and the references requests hold on them now (for operators, and the soak)."""
        usage = inference.cartridge_usage()
        return usage or {"cartridges": None, "metrics": None}

    add_weight_routes(app, inference, weights_dir, _parse)
    for path, (model, make_call) in ROUTES.items():
        async def endpoint(raw: Request, model=model, make_call=make_call) -> Any:
            return await service.handle(raw, model, make_call)

        app.post(path)(endpoint)
    return app


def _add_error_handlers(app: FastAPI, redact: Redactor) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(redact), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=code).body(redact),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(redact), status_code=500)


def _add_auth(app: FastAPI, api_key: str) -> None:
    @app.middleware("http")
    async def _auth(request: Request, call_next):
        given = request.headers.get("authorization", "")
        if request.url.path != "/ping" and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            err = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
            return JSONResponse(err.body(), status_code=401)
        return await call_next(request)


async def _chain(first: Any, rest: AsyncIterator) -> AsyncIterator:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _parse(raw: Request, model: type[BaseModel], max_bytes: int) -> Any:
    body = await read_body(raw, max_bytes)
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def _cancel_on_disconnect(raw: Request, work: Awaitable) -> Any:
    """Run `work`, cancelling it (which aborts its engine requests) if the client goes away first.

    The pattern of Tokasaurus' and vLLM's `with_cancellation`: the body has been read, so the next ASGI
    message is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected", code="client_closed_request")
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class ServerThread:
    """uvicorn serving an app on a background thread (tests, notebooks). port=0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="final-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.02)
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
