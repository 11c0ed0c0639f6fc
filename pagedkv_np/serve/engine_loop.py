"""The engine thread: the one owner of an OrtDecoder while a server runs.

``OrtDecoder.step`` is not safe to call from several threads, and one step
of a batch takes milliseconds to tens of milliseconds of CPU: it runs in one
dedicated thread, never on the event loop. The HTTP side talks to it
through two thread-safe calls, :meth:`EngineLoop.submit` and
:meth:`EngineLoop.cancel`, which only append to a command list; the thread
applies the commands between steps, runs ``step()``, turns each request's
new tokens into text with that request's own :class:`TextStream` (for the
server, :class:`pagedkv_np.text.streaming.TextStream`), and hands
:class:`Update` objects back through the request's ``emit`` callable (for the
server, a ``loop.call_soon_threadsafe`` into an ``asyncio.Queue``).

Queue bound: a request counts as *queued* from :meth:`~EngineLoop.submit`
until its first token (or its end); when ``max_queue`` requests are queued,
``submit`` raises :class:`QueueFull` at once instead of letting the backlog
grow.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable

from ..errors import PagedKVError
from ..checks import check_positive_int
from .logprobs import HeldLogprobs
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..onnxruntime import OrtDecoder

__all__ = ["EngineLoop", "Job", "Update", "TextStream", "QueueFull", "EngineStopped"]


class QueueFull(PagedKVError, RuntimeError):
    """``max_queue`` requests already wait for their first token."""


class EngineStopped(PagedKVError, RuntimeError):
    """The engine thread has stopped (shutdown, or a fatal error)."""


class TextStream(Protocol):
    """Token ids in, text deltas out, for one request.

    ``push`` returns the text that is final so far (never half a character,
    never text a stop string may still claim); ``finish`` returns what was
    held back. ``stopped`` turns True once a stop string matched; the text
    before it has then been returned and nothing after it ever is. ``text``
    is every delta returned; ``detokenizer.text`` every character decoded
    (the stop matcher's input), which places each token's text for the
    logprobs kept with it (:class:`~pagedkv_np.serve.logprobs.HeldLogprobs`).
    """

    detokenizer: Any

    @property
    def text(self) -> str: ...

    @property
    def stopped(self) -> bool: ...

    def push(self, token_ids: list[int]) -> str: ...

    def finish(self) -> str: ...


@dataclass(frozen=True)
class Update:
    """What the engine thread tells a request's HTTP handler.

    A request gets any number of updates with ``finish_reason`` None (text
    deltas, possibly empty), then exactly one with ``finish_reason`` set:
    ``"stop"``, ``"length"``, ``"abort"`` (shutdown) or ``"error"`` (then
    ``error`` says why). The token counts are set on the last one.
    """

    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    error: BaseException | None = None
    #: ``TokenLogprob`` of this update's tokens, for a job that asked for them
    logprobs: tuple = ()
    #: the choice (0 to n - 1) of a request with ``n`` continuations; the
    #: HTTP side sets it (``dataclasses.replace``) when the update reaches it
    index: int = 0


class Job:
    """A request as the engine thread carries it.

    Parameters
    ----------
    prompt_ids : ndarray, shape [num_prompt_tokens], dtype int64
    max_tokens : int
    stream : TextStream
    emit : callable
        ``emit(update)``, called from the engine thread; must not block.
    sampling : dict
        ``temperature``, ``top_p``, ``top_k``, ``seed`` and the further options
        (penalties, ``logit_bias``...) for ``add_request``.
    salt : str, optional
    arrival : float
        ``time.perf_counter()`` when the request arrived (for TTFT).
    """

    __slots__ = ("prompt_ids", "max_tokens", "stream", "emit", "sampling", "salt", "arrival",
                 "rid", "num_generated", "num_cached", "last_token_time", "done", "group",
                 "held")

    def __init__(self, prompt_ids: Any, max_tokens: int, stream: TextStream,
                 emit: Callable[[Update], None], *, sampling: dict | None = None,
                 salt: str | None = None, arrival: float | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.stream = stream
        self.emit = emit
        self.sampling = dict(sampling or {})
        self.salt = salt
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.rid: int | None = None
        self.num_cached = 0   # prompt tokens from the prefix cache (StepEvents.admitted)
        self.num_generated = 0
        self.last_token_time: float | None = None
        self.done = False
        # the jobs of one prompt's n continuations (add_parallel_requests), set
        # on the first of them by EngineLoop.submit_parallel
        self.group: list[Job] | None = None
        # logprobs of tokens whose text a stop string may still cut
        self.held = HeldLogprobs()


class EngineLoop:
    """Runs an OrtDecoder in a thread of its own (see the module docstring).

    Parameters
    ----------
    decoder : OrtDecoder
        Owned by the loop from :meth:`start` on: nobody else may call its
        ``step``, ``abort`` or ``pop_output``.
    max_queue : int
        Most requests waiting for their first token.
    metrics : ServerMetrics, optional
    """

    def __init__(self, decoder: OrtDecoder, *, max_queue: int = 64,
                 metrics: ServerMetrics | None = None) -> None:
        self.decoder = decoder
        self.max_queue = check_positive_int(max_queue, "max_queue")
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Job]] = []   # guarded by _cond
        self._num_queued = 0                         # guarded by _cond
        self._stopping = False                       # guarded by _cond
        self._active: dict[int, Job] = {}            # engine thread only
        self._thread: threading.Thread | None = None
        self.fatal_error: BaseException | None = None

    # ------------------------------------------------------ any thread
    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def start(self) -> None:
        if self._thread is not None:
            return
        self._publish()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; its updates arrive through ``job.emit``.

        Raises
        ------
        QueueFull
            ``max_queue`` jobs are already waiting for their first token.
        EngineStopped
            The loop is stopping or has died.
        """
        with self._cond:
            if self._stopping or not self.is_alive:
                raise EngineStopped("the engine is not running")
            if self._num_queued >= self.max_queue:
                raise QueueFull(f"{self._num_queued} requests are already queued "
                                f"(max_queue = {self.max_queue})")
            self._num_queued += 1
            self._commands.append(("submit", job))
            self._cond.notify()

    def submit_parallel(self, jobs: list[Job]) -> None:
        """Queue the jobs of ``len(jobs)`` continuations of one prompt (the
        first job's prompt, budget and sampling options): the prompt is
        computed once (``add_parallel_requests``). Each job counts as queued,
        and is cancelled, on its own; raises as :meth:`submit` does."""
        with self._cond:
            if self._stopping or not self.is_alive:
                raise EngineStopped("the engine is not running")
            if self._num_queued + len(jobs) > self.max_queue:
                raise QueueFull(f"{self._num_queued} requests are already queued "
                                f"(max_queue = {self.max_queue})")
            self._num_queued += len(jobs)
            jobs[0].group = list(jobs)
            self._commands.append(("submit", jobs[0]))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Abort a job (its client went away); its pages go back to the pool."""
        with self._cond:
            self._commands.append(("cancel", job))
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every remaining job (each gets a last update, ``"abort"``)
        and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (not self._commands and not self._stopping
                           and not self.decoder.has_unfinished_requests()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for kind, job in commands:
                    if kind == "submit":
                        self._add(job)
                    else:
                        self._abort(job, None)
                if stopping:
                    for job in list(self._active.values()):
                        self._abort(job, "abort")
                    self.decoder.settle()      # the finished ones' K/V into the pages
                    break
                if self.decoder.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as exc:   # a bug: fail every request rather than hang them
            self.fatal_error = exc
            traceback.print_exc()
            for job in list(self._active.values()):
                self._fail(job, exc)
            with self._cond:
                pending, self._commands = self._commands, []
                self._stopping = True
            for kind, job in pending:
                if kind == "submit":
                    self._fail(job, exc)
        finally:
            self._publish()

    def _dequeue(self, job: Job) -> None:
        """The job no longer counts as queued (first token, or its end)."""
        if job.num_generated == 0 and not job.done:
            with self._cond:
                self._num_queued -= 1

    def _add(self, job: Job) -> None:
        jobs = job.group or [job]
        try:
            if job.group is None:
                rids = [self.decoder.add_request(job.prompt_ids, job.max_tokens, salt=job.salt,
                                                 **job.sampling)]
            else:
                rids = self.decoder.add_parallel_requests(job.prompt_ids, len(jobs),
                                                          job.max_tokens, salt=job.salt,
                                                          **job.sampling)
        except Exception as exc:   # the HTTP side tells bad input from a fault by type
            for each in jobs:
                self._fail(each, exc)
            return
        for each, rid in zip(jobs, rids):
            each.rid = rid
            self._active[rid] = each

    def _finish(self, job: Job, update: Update) -> None:
        self._dequeue(job)
        job.done = True
        if job.rid is not None:
            self._active.pop(job.rid, None)
        self.metrics.finished.labels(update.finish_reason).inc()
        self.metrics.prompt_tokens.inc(update.num_prompt_tokens)
        job.emit(update)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job.done:
            return
        if job.rid is not None:
            self._forget(job.rid)
        self._finish(job, Update(finish_reason="error", error=exc,
                                 num_prompt_tokens=len(job.prompt_ids),
                                 num_completion_tokens=job.num_generated))

    def _forget(self, rid: int) -> None:
        """Abort (if still running) and drop a request from the decoder."""
        dec = self.decoder
        try:
            dec.abort(rid)
            dec.pop_output(rid)
        except PagedKVError:
            pass   # already gone

    def _abort(self, job: Job, reason: str | None) -> None:
        """End a job early: ``reason`` None when its client left (nothing is
        sent), ``"abort"`` at shutdown."""
        if job.done or job.rid is None:
            return
        counts = self._counts(job)
        self._forget(job.rid)
        if reason is None:
            self._dequeue(job)
            job.done = True
            self._active.pop(job.rid, None)
            self.metrics.finished.labels("cancelled").inc()
            return
        self._finish(job, Update(job.stream.finish(), reason, *counts))

    @staticmethod
    def _counts(job: Job) -> tuple[int, int, int]:
        """(prompt tokens, cached prompt tokens, generated tokens)."""
        return len(job.prompt_ids), job.num_cached, job.num_generated

    def _step(self) -> None:
        dec = self.decoder
        try:
            events = dec.step()
        except Exception as exc:
            # a failure the engine did not pin on one request (those come in
            # events.errors): every running request is concerned
            traceback.print_exc()
            for running in list(self._active.values()):
                self._fail(running, exc)
            return
        now = time.perf_counter()
        metrics = self.metrics
        finished = events.finished
        for rid, num_cached in events.admitted.items():
            admitted = self._active.get(rid)
            if admitted is not None:
                admitted.num_cached = num_cached
        for rid, error in events.errors.items():
            failed = self._active.get(rid)
            if failed is not None:
                self._fail(failed, error)
        for rid, tokens in events.items():
            job = self._active.get(rid)
            if job is None or not tokens:
                continue
            if job.last_token_time is None:
                metrics.ttft.observe(now - job.arrival)
                self._dequeue(job)
                rest = len(tokens) - 1
            else:
                rest = len(tokens)
            if rest:
                gap = (now - (job.last_token_time or now)) / rest
                for _ in range(rest):
                    metrics.itl.observe(gap)
            job.last_token_time = now
            job.num_generated += len(tokens)
            metrics.generation_tokens.inc(len(tokens))
            job.held.add(events.logprobs.get(rid, ()), len(job.stream.detokenizer.text))
            delta = job.stream.push(list(tokens))
            if job.stream.stopped or rid in finished:
                stopped = job.stream.stopped
                reason = ("stop" if stopped
                          else self._reason(events.statuses[rid].finish_reason))
                delta += job.stream.finish()
                # past a stop string: only the tokens of the returned text
                entries = (job.held.release(len(job.stream.text)) if job.stream.stopped
                           else job.held.rest())
                counts = self._counts(job)
                self._forget(rid)
                self._finish(job, Update(delta, reason, *counts, logprobs=entries))
                continue
            entries = job.held.release(len(job.stream.text))
            if delta or entries:
                job.emit(Update(delta, logprobs=entries))
        # requests that ended in this step without a new token
        for rid in finished:
            ended = self._active.get(rid)
            if ended is not None:
                reason = self._reason(events.statuses[rid].finish_reason)
                counts = self._counts(ended)
                self._forget(rid)
                text = ended.stream.finish()
                self._finish(ended, Update(text, reason, *counts, logprobs=ended.held.rest()))

    @staticmethod
    def _reason(engine_reason: str | None) -> str:
        """"stop" (an end token) or "length" (max_tokens) for a finished job."""
        return "length" if engine_reason == "length" else "stop"

    def _publish(self) -> None:
        try:
            stats = dict(self.decoder.stats)
        except Exception:   # a decoder mid-failure: keep the last figures
            return
        stats["num_queued"] = self._num_queued
        self.metrics.publish(stats)
