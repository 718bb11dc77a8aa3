"""Running a prepared request: on the embedded engine's running batch, or through InferenceEngine.agenerate.

With the local backend, requests go straight to `EmbeddedEngine.async_generate` from the server's event loop,
so concurrent HTTP requests join one running batch (continuous batching) and a disconnect aborts the request.
Other backends (sglang, tokasaurus) run through `InferenceEngine.agenerate`, one call at a time on the rollout
thread (veRL's generate_sequences blocks its loop); their "stream" is the whole completion as one update.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from final.errors import CartridgeError


@dataclass
class Job:
    """One HTTP request, normalized: token ids per prompt and SGLang sampling params (n kept apart)."""

    prompts: list[list[int]]
    sampling: dict[str, Any]
    n: int = 1
    logprobs: bool = False
    cartridges: list[dict] = field(default_factory=list)  # Tokasaurus specs {id, source, force_redownload}


@dataclass
class Sample:
    """One choice (index = prompt * n + sample), final or partial (finish_reason None while streaming)."""

    index: int
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int | None = None


def _sample(index: int, out: dict) -> Sample:
    meta = out["meta_info"]
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    pairs = meta.get("output_token_logprobs")
    return Sample(index, list(out["output_ids"]), [lp for lp, _, _ in pairs] if pairs is not None else None,
                  kind, int(meta.get("prompt_tokens", 0)), meta.get("cached_tokens"))


class EngineBackend:
    """The embedded engine, called from the server's loop; cartridges held for each request's lifetime."""

    def __init__(self, inference, cartridge_dir: str | None = None):
        self.inference = inference
        self.engine = inference.engine
        self.cartridge_dir = Path(cartridge_dir).resolve() if cartridge_dir else None

    @contextlib.asynccontextmanager
    async def hold(self, specs: list[dict]) -> AsyncIterator[tuple[str, ...]]:
        """Load (on demand, off the event loop) and reference the request's cartridges while it runs."""
        if not specs:
            yield ()
            return
        service = self.inference.cartridges
        if service is None:
            raise CartridgeError(f"the {self.inference.backend} backend serves no cartridges", field="cartridges")
        self._check_local_files(specs, service.ids())
        using = service.using(specs)
        loading = asyncio.ensure_future(asyncio.to_thread(using.__enter__))
        try:
            ids = await asyncio.shield(loading)
        except asyncio.CancelledError:  # the client left mid-load: release what the load thread takes
            loading.add_done_callback(lambda f: f.cancelled() or f.exception() or using.__exit__(None, None, None))
            raise
        try:
            yield ids
        finally:
            using.__exit__(None, None, None)
            if len(ids) > 1 and self.engine is not None:
                self.engine.flush_cache()  # drop the composed A+B prefix unless another request still runs it

    def _check_local_files(self, specs: list[dict], loaded: list[str]) -> None:
        """HTTP clients may load local files only from --cartridge-dir: a request must not read any path."""
        for spec in specs:
            if not isinstance(spec, dict) or spec.get("source", "local") != "local":
                continue
            name = spec.get("path") or spec.get("id")
            if spec.get("id") in loaded and not spec.get("force_redownload") and not spec.get("path"):
                continue
            if self.cartridge_dir is None:
                raise CartridgeError("loading local cartridge files over HTTP is off; start the server with "
                                     "--cartridge-dir DIR to allow files under DIR", file=str(name), field="source")
            path = Path(str(name)).expanduser()
            resolved = (path if path.is_absolute() else self.cartridge_dir / path).resolve()
            if not resolved.is_relative_to(self.cartridge_dir):
                raise CartridgeError(f"is outside the server's --cartridge-dir {self.cartridge_dir}", file=str(name),
                                     field="id")

    async def generate(self, job: Job, cartridge_ids: tuple[str, ...]) -> list[Sample]:
        async def one(i: int, ids: list[int]) -> list[Sample]:
            out = await self.engine.async_generate(input_ids=ids, sampling_params=dict(job.sampling, n=job.n),
                                                   return_logprob=job.logprobs, cartridges=cartridge_ids or None)
            outs = out if isinstance(out, list) else [out]
            return [_sample(i * job.n + j, o) for j, o in enumerate(outs)]

        tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(job.prompts)]
        try:
            groups = await asyncio.gather(*tasks)
        except BaseException:  # one failed prompt aborts the others (a disconnect cancels them all)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [s for group in groups for s in group]

    async def open_streams(self, job: Job, cartridge_ids: tuple[str, ...]) -> list[AsyncIterator[dict]]:
        """One engine stream per choice, opened now so bad input fails before the HTTP response starts.

        Sample j of a seeded request gets seed+j, exactly what the engine gives the n>1 rows of one request."""
        seed = job.sampling.get("seed")
        streams = []
        try:
            for ids in job.prompts:
                for j in range(job.n):
                    params = dict(job.sampling, n=1, seed=seed + j if seed is not None else None)
                    streams.append(await self.engine.async_generate(
                        input_ids=ids, sampling_params=params, return_logprob=job.logprobs,
                        cartridges=cartridge_ids or None, stream=True))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    async def stream(self, job: Job, cartridge_ids: tuple[str, ...]) -> AsyncIterator[Sample]:
        """Updates of every choice as they come (cumulative ids), merged in arrival order."""
        streams = await self.open_streams(job, cartridge_ids)
        return _merge(streams)


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[Sample]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for out in stream:
                await queue.put(_sample(index, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


class RolloutBackend(EngineBackend):
    """Any other backend, through InferenceEngine.agenerate (veRL's generate_sequences, one call at a time)."""

    async def generate(self, job: Job, cartridge_ids: tuple[str, ...]) -> list[Sample]:
        sampling = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in job.sampling.items()
                    if v is not None}
        out = await self.inference.agenerate(job.prompts, cartridge=list(cartridge_ids) or None, n=job.n,
                                             logprobs=job.logprobs, progress=False, **sampling)
        return [Sample(i, m["response_ids"], m.get("logprobs"), m["finish_reason"], m["prompt_tokens"])
                for i, m in enumerate(out.metadata)]

    async def stream(self, job: Job, cartridge_ids: tuple[str, ...]) -> AsyncIterator[Sample]:
        """No token-level stream through veRL's batch call: each choice arrives once, complete."""
        samples = await self.generate(job, cartridge_ids)

        async def once() -> AsyncIterator[Sample]:
            for s in samples:
                yield s

        return once()


def backend_for(inference, cartridge_dir: str | None = None) -> EngineBackend:
    cls = EngineBackend if inference.engine is not None else RolloutBackend
    return cls(inference, cartridge_dir)
