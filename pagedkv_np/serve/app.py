"""The Starlette application and its uvicorn runner.

Routes::

    POST /v1/chat/completions   chat, streamed (SSE) or whole
    POST /v1/completions        plain prompts (text or token ids)
    GET  /v1/models             the one model served
    GET  /v1/models/{model}     that model, or 404 ``model_not_found``
    POST /tokenize              text or messages -> token ids (llama.cpp's and vLLM's shapes)
    POST /detokenize            token ids -> text
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text

A request whose ``model`` is not the served name (``--served-model-name``,
default the model's file or folder name) is a 404 ``model_not_found``, as
vLLM answers; a request without ``model`` is served. Unknown request fields
are ignored, and each name is logged once. With ``access_log``, every
request is logged in one line (method, path, status, milliseconds, prompt
and generated tokens).

Each generation request's body is read under the limits of
:mod:`~pagedkv_np.serve.limits` (size, deadline), then parsed, checked and
tokenized in a small thread pool, never on the event loop (a long prompt
takes seconds to tokenize and ``/health`` and every stream must not wait for
it), then handed to the :class:`~pagedkv_np.serve.engine_loop.EngineLoop` as a
:class:`~pagedkv_np.serve.engine_loop.Job` whose ``emit`` schedules the
engine thread's updates onto the event loop (``call_soon_threadsafe``). A
client that goes away cancels its job: a stream sees the cancellation when
Starlette notices the disconnect, a whole response watches ``http.disconnect``
while it waits.

A client that leaves while still sending its body is answered (to nobody)
with ``499``, counted as such in ``pagedkv_http_requests_total`` and logged
in one line: it is not a server error.

Tenants: with API keys, every key is a tenant of its own (its prompts share
cached pages only with its own); a request's ``cache_salt`` splits further.
``/metrics`` needs a key when keys are set (it shows every tenant's prefix
hits); ``/health`` never does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any
from collections.abc import AsyncIterator, Iterable

from .engine_loop import EngineLoop, EngineStopped, Job, QueueFull, Update
from .grammar import constraint_for, warm_grammar
from .http_errors import (EXCEPTION_HANDLERS, USAGE_KEY, Metered, api_error, error_response,
                          shutdown_error)
from .limits import BodyLimits, ServerLimits, http_protocol
from .logprobs import LogprobWriter
from .mailbox import Mailbox
from .metrics import CONTENT_TYPE
from .prompts import PromptBuilder
from .protocol import (APIError, GenerationRequest, parse_chat, parse_completion, parse_json,
                       unknown_fields)
from .responses import (SSE_DONE, best_choices, chat_chunk, chat_response, choices_usage,
                        completion_response, sse, update_events, usage_chunk)
from .tenants import cache_salt, tenant_of
from .tokenize import Tokenizing
from .tools import tool_stream

if TYPE_CHECKING:
    from ..onnxruntime import OrtDecoder

try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("pagedkv_np.serve needs starlette and uvicorn: "
                      "pip install 'pagedkv-np[serve]'") from exc

__all__ = ["create_app", "run_server"]

_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
           "/tokenize", "/detokenize")
# distinct unknown field names logged at most (a client could send endless new ones)
_MAX_LOGGED_FIELDS = 256
# threads that parse and tokenize request bodies: the tokenizer releases the
# GIL, so they run beside the event loop; more would only take cores from
# the engine
_PREPARE_THREADS = 2
_log = logging.getLogger("pagedkv_np.serve")


class _Server:
    """The request handlers of one app (state shared by its routes)."""

    def __init__(self, engine: EngineLoop, model_id: str, api_keys: Iterable[str],
                 fim: tuple[int, int, int] | None = None) -> None:
        self.engine = engine
        self.model_id = model_id
        self.api_keys = tuple(api_keys)
        self.prompts = PromptBuilder(engine.decoder, fim)
        self.tokenizing = Tokenizing(self.prompts)
        self._logged_fields: set[str] = set()   # guarded by _fields_lock
        self._fields_lock = threading.Lock()
        self.created = int(time.time())
        self.mailbox: Mailbox | None = None   # made on the event loop, at the first request
        self.pool = concurrent.futures.ThreadPoolExecutor(_PREPARE_THREADS,
                                                          thread_name_prefix="pagedkv-prepare")

    # ------------------------------------------------------------ helpers
    def tenant(self, request: Request) -> str | None:
        """The caller's tenant id (:func:`~pagedkv_np.serve.tenants.tenant_of`)."""
        return tenant_of(self.api_keys, request.headers.get("authorization", ""))

    # ------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        if self.engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        self.tenant(request)   # every tenant's prefix hits: not for anonymous callers
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "pagedkv_np", "max_model_len": self.prompts.context_length}

    def check_model(self, name: str | None) -> None:
        """A 404 ``model_not_found`` unless ``name`` is None or the served name."""
        if name is not None and name != self.model_id:
            raise APIError(f"The model '{name}' does not exist (this server serves "
                           f"'{self.model_id}')", status=404, code="model_not_found",
                           param="model")

    async def models(self, request: Request) -> Response:
        self.tenant(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        self.tenant(request)
        self.check_model(request.path_params["model"])
        return JSONResponse(self.model_card())

    async def tokenize(self, request: Request) -> Response:
        self.tenant(request)
        body = await request.body()
        return JSONResponse(await asyncio.get_running_loop().run_in_executor(
            self.pool, self.tokenizing.tokenize, body))

    async def detokenize(self, request: Request) -> Response:
        self.tenant(request)
        body = await request.body()
        return JSONResponse(await asyncio.get_running_loop().run_in_executor(
            self.pool, self.tokenizing.detokenize, body))

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def generate(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        tenant = self.tenant(request)
        body = await request.body()
        req, ids, max_tokens, constraint = await asyncio.get_running_loop().run_in_executor(
            self.pool, self.prepare, body, kind)
        usage = request.scope.get(USAGE_KEY)
        if usage is not None:
            usage["prompt_tokens"] = int(ids.shape[0])
        if self.mailbox is None:
            self.mailbox = Mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue[Update] = asyncio.Queue()
        sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                    "seed": req.seed, "constraint": constraint, **req.engine_options}
        salt = cache_salt(tenant, req.cache_salt)
        jobs = [Job(ids, max_tokens, self.prompts.text_stream(req),
                    functools.partial(self.mailbox.post_choice, queue, i),
                    sampling=sampling, salt=salt, arrival=arrival) for i in range(req.best_of)]
        try:
            if req.best_of == 1:
                self.engine.submit(jobs[0])
            else:
                self.engine.submit_parallel(jobs)
        except (QueueFull, EngineStopped) as exc:
            if isinstance(exc, QueueFull):
                self.engine.metrics.rejected.inc()
            raise api_error(exc) from None
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        response_id, created = prefix + uuid.uuid4().hex, int(time.time())
        model = req.model or self.model_id
        if req.stream:
            return StreamingResponse(self.stream(jobs, queue, req, response_id, created, model,
                                                 usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self.whole(request, jobs, queue, req, response_id, created, model, usage)

    def prepare(self, body: bytes, kind: str) -> tuple[GenerationRequest, Any, int, Any]:
        """The checked request, its prompt ids, its token budget and its
        ``response_format`` constraint (in a pool thread).

        Raises
        ------
        APIError
            400 for anything wrong with the body (see ``protocol`` and
            ``prompts``).
        """
        data = parse_json(body)
        self.log_unknown(data)
        req = self.prompts.bind_tools(parse_chat(data) if kind == "chat"
                                      else parse_completion(data))
        self.check_model(req.model)
        ids = self.prompts.prompt_ids(req)
        max_tokens = self.prompts.max_tokens(req, int(ids.shape[0]))
        self.prompts.check_options(req, max_tokens)
        most = self.engine.decoder.max_batch_size
        if req.best_of > most:   # best_of is n unless given
            name = "n" if req.best_of == req.n else "best_of"
            raise APIError(f"Invalid value for '{name}': at most {most} choices (the server's "
                           f"max batch size), got {req.best_of}", param=name,
                           code="invalid_value")
        return req, ids, max_tokens, constraint_for(self.engine.decoder, data, req.tools)

    def log_unknown(self, data: dict) -> None:
        """Log each unknown field name once (the first few hundred names)."""
        names = unknown_fields(data)
        if not names:
            return
        with self._fields_lock:
            new = [n for n in names if n not in self._logged_fields]
            new = new[:max(0, _MAX_LOGGED_FIELDS - len(self._logged_fields))]
            self._logged_fields.update(new)
        for name in new:
            _log.info("ignoring unknown request field %r (logged once)", name[:64])

    async def whole(self, request: Request, jobs: list[Job], queue: asyncio.Queue,
                    req: GenerationRequest, response_id: str, created: int, model: str,
                    note: dict | None = None) -> Response:
        parts: list[list[str]] = [[] for _ in jobs]
        writers = [self.logprob_writer(req) for _ in jobs]
        logprobs: list[list[dict]] = [[] for _ in jobs]
        scores = [0.0] * len(jobs)   # cumulative token logprobs, for best_of
        last: dict[int, Update] = {}
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while len(last) < len(jobs):
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    self.cancel(jobs)
                    return Response(status_code=499)   # nobody reads it
                update: Update = get.result()
                parts[update.index].append(update.text)
                scores[update.index] += sum(e.logprob for e in update.logprobs)
                writer = writers[update.index]
                if writer is not None and update.logprobs:
                    logprobs[update.index].append(writer.format(update.logprobs))
                if update.finish_reason is not None:
                    last[update.index] = update
                    if update.finish_reason in ("error", "abort"):
                        break
        finally:
            gone.cancel()
        if note is not None:
            note["completion_tokens"] = sum(u.num_completion_tokens for u in last.values())
        failed = [u for u in last.values() if u.finish_reason in ("error", "abort")]
        if failed:
            self.cancel(jobs)
            return error_response(api_error(failed[0].error) if failed[0].error is not None
                                  else shutdown_error())
        build = (functools.partial(chat_response, tools=req.tools) if req.kind == "chat"
                 else completion_response)
        choices = []
        for i, writer in enumerate(writers):
            joined = None
            if writer is not None:
                joined = LogprobWriter.join(logprobs[i]) or writer.format(())
            choices.append(("".join(parts[i]), last[i].finish_reason, joined))
        return JSONResponse(build(response_id, created, model, best_choices(choices, scores, req.n),
                                  choices_usage(list(last.values()))))

    def cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.engine.cancel(job)

    def logprob_writer(self, req: GenerationRequest) -> LogprobWriter | None:
        if req.options.get("logprobs") is None:
            return None
        return LogprobWriter(self.prompts.codec, req.kind)

    async def stream(self, jobs: list[Job], queue: asyncio.Queue, req: GenerationRequest,
                     response_id: str, created: int, model: str,
                     note: dict | None = None) -> AsyncIterator[bytes]:
        last: dict[int, Update] = {}
        finished = False
        writers = [self.logprob_writer(req) for _ in jobs]
        calls = [tool_stream(req.tools) for _ in jobs]
        try:
            if req.kind == "chat":
                yield b"".join(sse(chat_chunk(response_id, created, model,
                                              {"role": "assistant", "content": ""}, index=i))
                               for i in range(len(jobs)))
            while not finished:
                # everything that has arrived goes out in one write
                updates = [await queue.get()]
                while not queue.empty():
                    updates.append(queue.get_nowait())
                out: list[bytes] = []
                for update in updates:
                    out.extend(update_events(update, req, response_id, created, model,
                                             writers[update.index], calls[update.index]))
                    if update.finish_reason is None:
                        continue
                    last[update.index] = update
                    finished = (len(last) == len(jobs)
                                or update.finish_reason in ("error", "abort"))
                    if finished:
                        if note is not None:
                            note["completion_tokens"] = sum(u.num_completion_tokens
                                                            for u in last.values())
                        if req.include_usage and update.finish_reason not in ("error", "abort"):
                            out.append(sse(usage_chunk(req.kind, response_id, created, model,
                                                       choices_usage(list(last.values())))))
                        out.append(SSE_DONE)
                        break
                yield b"".join(out)
        finally:
            if len(last) < len(jobs):   # the client went away, or a choice failed
                self.cancel(jobs)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine: EngineLoop, *, model_id: str, api_keys: Iterable[str] = (),
               limits: ServerLimits | None = None, access_log: bool = False,
               fim: tuple[int, int, int] | None = None) -> Any:
    """The ASGI application serving ``engine`` (started and stopped by its lifespan).

    Parameters
    ----------
    engine : EngineLoop
        Not yet started.
    model_id : str
        The model's name in ``/v1/models`` and in responses.
    api_keys : iterable of str
        Keys accepted as ``Authorization: Bearer KEY``; none: no check.
    limits : ServerLimits, optional
        The body size cap and body deadline (the header deadline and the
        connection limit are the HTTP server's: :func:`run_server`).
    access_log : bool
        Log one line per request.
    fim : (int, int, int), optional
        Fill-in-the-middle token ids (a GGUF file's), else the vocabulary's.
    """
    server = _Server(engine, model_id, api_keys, fim)
    cache = engine.decoder.cache
    engine.metrics.model_name = model_id
    engine.metrics.cache_config = {"block_size": str(cache.page_size),
                                   "num_gpu_blocks": str(cache.num_pages),
                                   "cache_dtype": str(cache.dtype)}
    limits = limits if limits is not None else ServerLimits()

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        engine.start()
        warm_grammar(engine.decoder)
        try:
            yield
        finally:
            # uvicorn has drained (or cancelled) the connections by now
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            server.pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model}", server.model, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    return Metered(BodyLimits(app, limits), engine.metrics.http_requests, _ROUTES,
                   access_log=access_log)


def run_server(decoder: OrtDecoder, *, model_id: str, host: str = "127.0.0.1", port: int = 8000,
               api_keys: Iterable[str] = (), max_queue: int = 64,
               graceful_timeout: int = 30, log_level: str = "info",
               limits: ServerLimits | None = None, access_log: bool = False,
               summary: str | None = None, fim: tuple[int, int, int] | None = None) -> None:
    """Serve ``decoder`` until SIGINT or SIGTERM.

    On a signal the server stops accepting connections, lets running
    requests finish for up to ``graceful_timeout`` seconds (then cancels
    them, which aborts them in the engine), and stops the engine thread.
    ``limits`` (default :class:`ServerLimits`) bound request bodies, read
    deadlines and open connections. ``access_log``: one line per request;
    ``summary``: a line logged once at start-up; ``fim``: fill-in-the-middle
    token ids (:func:`create_app`).
    """
    try:
        import uvicorn
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("pagedkv serve needs uvicorn: pip install 'pagedkv-np[serve]'") \
            from exc
    limits = limits if limits is not None else ServerLimits()
    engine = EngineLoop(decoder, max_queue=max_queue)
    app = create_app(engine, model_id=model_id, api_keys=api_keys, limits=limits,
                     access_log=access_log, fim=fim)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=int(graceful_timeout),
                            http=http_protocol(limits),
                            limit_concurrency=limits.max_connections)
    # the server's own lines go where uvicorn's go (its "uvicorn" logger's
    # handlers), at the level of its error log
    _log.handlers = list(logging.getLogger("uvicorn").handlers)
    _log.propagate = False
    _log.setLevel(logging.getLogger("uvicorn.error").level)
    if summary is not None:
        _log.info("%s", summary)
    # uvicorn raises the signal it stopped on again once it is done; a
    # shutdown that went as planned should end the process with status 0
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(signum: int, frame: Any) -> None:
    """A signal that has already been handled."""
