"""The FastAPI app of `final serve`: Tokasaurus' endpoints on one InferenceEngine.

Endpoints, as in ScalingIntelligence/tokasaurus (branch geoff/cartridges) tokasaurus/server/endpoints.py:
  GET  /ping                              {"message": "pong"}
  GET  /v1/models
  POST /v1/completions, /v1/chat/completions                          OpenAI (stream: SSE)
  POST /custom/cartridge/completions, /custom/cartridge/chat/completions
       the same bodies + cartridges: [{id, source, force_redownload}]
       (also under /v1/cartridge/..., the names older Tokasaurus branches and clients use)
  POST /generate                          seed 001's native `protocol: toka` body (not in real Tokasaurus)
Not served: files/batches and the pickled synchronous-batch endpoints (we never send pickles).
Errors are OpenAI-style JSON (final/server/errors.py); a request's failure never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from final.errors import FinalError
from final.server import prepare, protocol
from final.server.errors import APIError, from_final, from_validation
from final.server.generation import backend_for
from final.server.responses import Renderer
from final.server.streaming import sse

logger = logging.getLogger(__name__)


def create_app(inference, api_key: str | None = None, cartridge_dir: str | None = None) -> FastAPI:
    """An app serving `inference` (an InferenceEngine); with api_key, every route but /ping needs the bearer key.
    Requests may load local cartridge files only from `cartridge_dir` (none: only already-loaded ids)."""
    app = FastAPI(title="final serve", docs_url=None, redoc_url=None)
    backend = backend_for(inference, cartridge_dir)
    limits = prepare.Limits(inference.tokenizer, inference.rollout_config.prompt_length,
                            inference.rollout_config.response_length)
    renderer = Renderer(inference.tokenizer, inference.eos_token_ids)
    model_id = inference.config.model_path

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    if api_key:
        @app.middleware("http")
        async def _auth(request: Request, call_next):
            given = request.headers.get("authorization", "")
            if request.url.path != "/ping" and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
            return await call_next(request)

    @app.get("/ping")
    async def ping() -> dict:
        return {"message": "pong"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "final"}]}

    async def run(raw: Request, model: type[BaseModel], chat: bool, make_job) -> Any:
        req = await _parse(raw, model)
        prompt_param = "messages" if chat else "prompt"
        try:
            job = make_job(req, limits)
            want_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
            async with contextlib.AsyncExitStack() as stack:
                ids = await stack.enter_async_context(backend.hold(job.cartridges))
                if req.stream:  # engine streams open (and bad input fails) before the response starts
                    updates = await backend.stream(job, ids)
                    include = bool(req.stream_options and req.stream_options.include_usage)
                    events = sse(chat, req.model, job, updates, renderer, want_logprobs=want_logprobs,
                                 include_usage=include, prompt_param=prompt_param,
                                 on_close=stack.pop_all().aclose)  # the stream releases the cartridges
                    return StreamingResponse(events, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
                samples = await _cancel_on_disconnect(raw, backend.generate(job, ids))
        except FinalError as exc:
            raise from_final(exc, prompt_param) from exc
        render = renderer.chat if chat else renderer.completion
        return render(req.model, samples, job, want_logprobs=want_logprobs, fingerprint=req.logprobs_in_fingerprint)

    def route(path: str, model: type[BaseModel], chat: bool, make_job, *aliases: str) -> None:
        async def endpoint(raw: Request) -> Any:
            return await run(raw, model, chat, make_job)

        for p in (path, *aliases):
            app.post(p)(endpoint)

    route("/v1/completions", protocol.CompletionsRequest, False, prepare.completion_job)
    route("/v1/chat/completions", protocol.ChatCompletionRequest, True, prepare.chat_job)
    route("/custom/cartridge/completions", protocol.CartridgeCompletionsRequest, False, prepare.completion_job,
          "/v1/cartridge/completions")
    route("/custom/cartridge/chat/completions", protocol.CartridgeChatCompletionRequest, True, prepare.chat_job,
          "/v1/cartridge/chat/completions")

    @app.post("/generate")
    async def generate(raw: Request) -> dict:
        req = await _parse(raw, protocol.GenerateRequest)
        try:
            job = prepare.generate_job(req, limits)
            async with backend.hold(job.cartridges) as ids:
                samples = await _cancel_on_disconnect(raw, backend.generate(job, ids))
        except FinalError as exc:
            raise from_final(exc, "prompt") from exc
        return renderer.generate(req.model, samples[0], job)

    return app


async def _parse(raw: Request, model: type[BaseModel]) -> Any:
    body = await raw.body()
    try:
        return model.model_validate_json(body or b"null")
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
