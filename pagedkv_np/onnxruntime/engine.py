"""OrtDecoder: continuous batching over an ONNX decoder, K/V kept in a PagedKVCache.

One :meth:`OrtDecoder.step` does, in order::

    decode   every running request feeds its last token (one model call for
             the batch); if the pool cannot give each one a slot, the
             youngest requests are preempted (pages released into the
             prefix index, recomputed later from prompt + generated tokens)
    admit    waiting requests, oldest first, while the batch has room and the
             pool has pages; each prefills only the part of its prompt the
             prefix index does not hold (one model call per request)

Why the data moves as it does:

- The model needs contiguous past K/V. They are gathered from the pages only
  when the batch changes (a request joins, leaves or is preempted). While it
  stays the same, the model's own buffers carry the past from step to step,
  and the new tokens' K/V goes into the pages in one write per layer every
  ``write_interval`` steps, and before anything reads or releases those
  pages (a change of batch, a finished, preempted or aborted request). A
  write per step would cost a plan and a call per layer each step, a few
  percent of a small model's step on a small CPU.
- optimum-family models concatenate past and new K/V into ``present``:
  ``present`` is the next step's ``past`` (no copy by the engine). The
  batch's past is gathered right padded with holes; ``attention_mask`` masks
  the holes and ``position_ids`` (or the mask's running sum) number the
  tokens.
- GroupQueryAttention models are driven as onnxruntime-genai drives them:
  past and present bound (IOBinding) to one preallocated buffer per layer,
  which the op fills in place; right padding; the capacity grows by a fresh
  gather when a sequence outgrows it.
- Prefill runs one request per call: GroupQueryAttention takes a batch of
  one when a step has both past context and several new tokens, and a lone
  prompt needs no padding.

Thread safety: :meth:`add_request` may be called from any thread; ``step``,
``generate`` and ``abort`` are serialised by a lock.
"""

from __future__ import annotations

import collections
import itertools
import numbers
import threading
from typing import Any, Iterable

import numpy as np

from ..cache import PagedKVCache
from ..errors import ConfigError, DTypeError, PagedKVError
from ..layout import check_positive_int
from ..prefix import encode_salt
from ..tokens import as_tokens
from .model_io import UnsupportedModelError, discover, graph_facts
from .runners import make_runner
from .sampling import SamplingParams, sample
from .textgen import TextGenerationMixin

try:
    import onnx
    import onnxruntime as ort
except ImportError as exc:  # pragma: no cover - __init__ reports this first
    raise ImportError(
        "pagedkv_np.onnxruntime needs onnxruntime and onnx: pip install 'pagedkv-np[onnx]'"
    ) from exc

__all__ = ["OrtDecoder", "RequestNotFound"]

# The GQA decode buffer holds at most this many positions beyond the longest
# sequence; a longer run is re-gathered into a larger buffer.
_MAX_HEADROOM = 512

class RequestNotFound(PagedKVError, KeyError):
    """No request with that id (never added, or its output was already taken)."""


class _Request:
    """A request's prompt, budget, sampler and progress.

    While running, every token but the last generated one has its K/V in the
    cache: ``seq.num_tokens == len(prompt) + len(generated) - 1``.
    """

    __slots__ = ("rid", "prompt", "max_new_tokens", "eos", "params", "rng", "salt",
                 "generated", "seq", "finished")

    def __init__(self, rid: int, prompt: np.ndarray, max_new_tokens: int, eos: frozenset[int],
                 params: SamplingParams, rng: np.random.Generator | None, salt: Any) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.params = params
        self.rng = rng
        self.salt = salt
        self.generated: list[int] = []
        # the cache Sequence while running, else None; Any because the running
        # loop relies on that state instead of narrowing it on every token
        self.seq: Any = None
        self.finished = False

    def all_tokens(self) -> np.ndarray:
        if not self.generated:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.generated, dtype=np.int64)])


def _load(model: Any):
    """(bytes or path for onnxruntime, ModelProto without weights for inspection)."""
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString(), model
    source: bytes | str
    if isinstance(model, (bytes, bytearray)):
        source, what = bytes(model), "the model bytes"
        parse = lambda: onnx.load_from_string(source)  # noqa: E731
    elif isinstance(model, str) or hasattr(model, "__fspath__"):
        source = str(model.__fspath__() if hasattr(model, "__fspath__") else model)
        what = repr(source)
        parse = lambda: onnx.load(source, load_external_data=False)  # noqa: E731
    else:
        raise DTypeError(f"Invalid model: expected a path, bytes or onnx.ModelProto, "
                         f"got {type(model).__name__}")
    try:
        return source, parse()
    except FileNotFoundError:
        raise ConfigError(f"Invalid model: no file {source!r}") from None
    except Exception as exc:   # protobuf's DecodeError and kin
        raise UnsupportedModelError(f"{what} is not an ONNX model: {exc}") from exc


def _make_rng(seed: Any) -> np.random.Generator:
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"Invalid seed: expected an int, SeedSequence or None ({exc})") from None


class OrtDecoder(TextGenerationMixin):
    """Generate with an ONNX decoder, continuous batching and prefix reuse.

    Parameters
    ----------
    model : str, path, bytes or onnx.ModelProto
        A decoder of a supported family (see
        :mod:`pagedkv_np.onnxruntime.model_io`); layers, K/V heads, head size
        and dtype are read from it.
    num_pages, page_size : int
        Size of the K/V pool (pages of ``page_size`` tokens, every layer).
    max_batch_size : int
        Most requests decoded together.
    eos_token_id : int or iterable of int, optional
        Default end-of-sequence token(s); a request stops after emitting one.
    backend, layout : str
        Of the :class:`~pagedkv_np.PagedKVCache`. The default store layout,
        HND, keeps each head's positions together as the model's
        ``[batch, kv_heads, T, head_dim]`` past and present do, so that page
        writes and gathers move longer runs than with NHD (as fast or up
        to 2x faster, most for 16-bit data).
    enable_prefix_caching : bool
        When False, every prompt is computed in full (for comparison).
    partial_page_reuse : bool
        Also reuse a shared prefix that ends inside a page (see
        :class:`~pagedkv_np.PagedKVCache`).
    write_interval : int
        Decode steps whose K/V stays in the model's buffers before it is
        written into the pages, in one call per layer (sooner when the batch
        changes or a request ends). 1 writes every step.
    family : {"auto", "optimum", "gqa"}
    num_kv_heads, head_dim : int, optional
        For models whose past inputs leave these dimensions symbolic.
    session_options : onnxruntime.SessionOptions, optional
    providers : list, optional
        Default ``["CPUExecutionProvider"]``.

    Attributes
    ----------
    io : ModelIO
        What was read from the model.
    cache : PagedKVCache
    session : onnxruntime.InferenceSession
    """

    def __init__(self, model: Any, *, num_pages: int = 512, page_size: int = 16,
                 max_batch_size: int = 8, eos_token_id: Any = None, backend: str = "auto",
                 layout: str = "HND", enable_prefix_caching: bool = True,
                 partial_page_reuse: bool = True, write_interval: int = 16,
                 family: str = "auto",
                 num_kv_heads: int | None = None,
                 head_dim: int | None = None, session_options: Any = None,
                 providers: list | None = None) -> None:
        self.max_batch_size = check_positive_int(max_batch_size, "max_batch_size")
        self.write_interval = check_positive_int(write_interval, "write_interval")
        self.eos_token_ids = self._parse_eos(eos_token_id)
        source, proto = _load(model)
        facts = graph_facts(proto)
        del proto
        self.session = ort.InferenceSession(
            source, sess_options=session_options,
            providers=providers or ["CPUExecutionProvider"])
        self.io = discover(self.session.get_inputs(), self.session.get_outputs(), facts,
                           family=family, num_kv_heads=num_kv_heads, head_dim=head_dim)
        io = self.io
        self.cache = PagedKVCache(io.num_layers, num_pages, page_size, io.num_kv_heads,
                                  io.head_dim, dtype=io.dtype, layout=layout, backend=backend,
                                  enable_prefix_caching=enable_prefix_caching,
                                  partial_page_reuse=partial_page_reuse)
        self._runner = make_runner(self.session, io)
        self._lock = threading.Lock()          # guards _incoming, _requests
        self._step_lock = threading.RLock()    # serialises steps
        self._ids = itertools.count()
        self._incoming: collections.deque[_Request] = collections.deque()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._requests: dict[int, _Request] = {}
        self._batch_rids: tuple[int, ...] | None = None
        self._batch: list[_Request] = []   # the requests in the runner's buffers
        self._pending = 0                  # their decode steps not yet in the pages
        self._counters = dict.fromkeys(
            ("prefix_hit_tokens", "prefix_query_tokens", "num_prefills", "num_decode_steps",
             "num_generated_tokens", "num_preemptions", "num_regathers"), 0)

    # ------------------------------------------------------------- requests
    @staticmethod
    def _parse_eos(eos: Any) -> frozenset:
        if eos is None:
            return frozenset()
        try:
            items = [eos] if isinstance(eos, numbers.Integral) else list(eos)
        except TypeError:
            raise DTypeError(f"Invalid eos_token_id: expected an integer or integers, "
                             f"got {type(eos).__name__}") from None
        for t in items:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise DTypeError(f"Invalid eos_token_id: expected integers, got {t!r}")
        return frozenset(int(t) for t in items)

    def add_request(self, prompt: Any, max_new_tokens: int = 64, *, eos_token_id: Any = None,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: Any = None, salt: Any = None) -> int:
        """Queue a request; returns its id. Thread-safe.

        Parameters
        ----------
        prompt : sequence of int, length >= 1
            Token ids in ``[0, vocab_size)``.
        max_new_tokens : int
            Stop after this many generated tokens.
        eos_token_id : int or iterable of int, optional
            Overrides the decoder's default; the end token is returned as the
            last generated token.
        temperature, top_k, top_p : see :class:`SamplingParams`
            ``temperature=0`` (the default) is greedy.
        seed : int or numpy SeedSequence, optional
            Seed of this request's sampler.
        salt : str, bytes or int, optional
            Requests share cached pages only with requests of the same salt.

        Raises
        ------
        DTypeError, ShapeError
            The prompt is not a 1-D sequence of integers, or is empty.
        ConfigError
            A token id is outside the vocabulary, or the prompt plus
            ``max_new_tokens`` cannot fit the pool (or the model's positions).
        """
        req = self._new_request(prompt, max_new_tokens, eos_token_id, temperature, top_k,
                                top_p, seed, salt)
        self._enqueue([req])
        return req.rid

    def _new_request(self, prompt, max_new_tokens, eos_token_id, temperature, top_k, top_p,
                     seed, salt) -> "_Request":
        """A checked request, not yet queued (see :meth:`add_request`)."""
        tokens = as_tokens(prompt, "prompt", allow_empty=False)
        encode_salt(salt)
        max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
        vocab = self.io.vocab_size
        if vocab is not None and int(tokens.max()) >= vocab:
            raise ConfigError(f"Invalid prompt: token id {int(tokens.max())} is outside the "
                              f"model's vocabulary [0, {vocab})")
        # every token but the last generated one is fed to the model and cached
        num_fed = tokens.shape[0] + max_new_tokens - 1
        page_size, num_pages = self.cache.page_size, self.cache.num_pages
        if -(-num_fed // page_size) > num_pages:
            raise ConfigError(
                f"Invalid prompt: {tokens.shape[0]} prompt tokens + max_new_tokens = "
                f"{max_new_tokens} need {-(-num_fed // page_size)} pages of {page_size} "
                f"tokens; the pool has {num_pages}")
        if self.io.max_positions is not None and num_fed > self.io.max_positions:
            raise ConfigError(
                f"Invalid prompt: {tokens.shape[0]} prompt tokens + max_new_tokens = "
                f"{max_new_tokens} exceed the model's {self.io.max_positions} positions")
        params = SamplingParams(temperature, top_k, top_p)
        eos = self.eos_token_ids if eos_token_id is None else self._parse_eos(eos_token_id)
        rng = None if params.greedy else _make_rng(seed)
        return _Request(-1, tokens, max_new_tokens, eos, params, rng, salt)

    def _enqueue(self, reqs: list) -> None:
        with self._lock:
            for req in reqs:
                req.rid = next(self._ids)
                self._requests[req.rid] = req
                self._incoming.append(req)

    def is_finished(self, request_id: int) -> bool:
        return self._get(request_id).finished

    def get_output(self, request_id: int) -> list[int]:
        """Tokens generated so far for a request (a copy)."""
        return list(self._get(request_id).generated)

    def pop_output(self, request_id: int) -> list[int]:
        """The tokens of a finished request; forgets the request."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise RequestNotFound(f"Invalid request_id: no request {request_id!r}")
            if not req.finished:
                raise ConfigError(f"Invalid request_id: request {request_id} is not finished")
            del self._requests[request_id]
        return req.generated

    def abort(self, request_id: int) -> None:
        """Stop a request now; its pages go back to the pool (full ones stay cached)."""
        with self._step_lock:
            req = self._get(request_id)
            if req.finished:
                return
            with self._lock:
                if req in self._incoming:
                    self._incoming.remove(req)
            if req in self._waiting:
                self._waiting.remove(req)
            if req.seq is not None:
                self._flush()
                self._running.remove(req)
                self.cache.release(req.seq)
                req.seq = None
            req.finished = True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._waiting or self._running)

    def _get(self, request_id: int) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise RequestNotFound(f"Invalid request_id: no request {request_id!r}")
        return req

    # ----------------------------------------------------------------- steps
    def step(self) -> dict[int, list[int]]:
        """Run one decode step for the batch, then admit and prefill waiting requests.

        Returns
        -------
        dict
            ``{request_id: [new token ids]}`` for every request that produced
            tokens in this step.
        """
        with self._step_lock:
            with self._lock:
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            events: dict[int, list[int]] = {}
            preempted = self._decode(events)
            if not preempted:
                self._admit(events)
            if not self._running:
                self._forget_batch()
            return events

    def generate(self, prompts: Iterable[Any], max_new_tokens: int = 64, *,
                 eos_token_id: Any = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Any = None, salt: Any = None) -> list[list[int]]:
        """Generate for every prompt; returns the new tokens of each, in order.

        With sampling, request ``i`` is seeded from ``SeedSequence(seed).spawn``,
        so the result does not depend on batching or preemption.
        """
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise DTypeError(f"Invalid prompts: expected a list of token id sequences, "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        seeds: list[np.random.SeedSequence] | list[None]
        if temperature:
            try:
                seeds = np.random.SeedSequence(seed).spawn(len(prompts))
            except (TypeError, ValueError) as exc:
                raise DTypeError(f"Invalid seed: {exc}") from None
        else:
            seeds = [None] * len(prompts)
        # every prompt is checked before any is queued
        reqs = [self._new_request(p, max_new_tokens, eos_token_id, temperature, top_k, top_p,
                                  s, salt) for p, s in zip(prompts, seeds)]
        with self._step_lock:
            self._enqueue(reqs)
            rids = [r.rid for r in reqs]
            while not all(self._requests[r].finished for r in rids):
                self.step()
            return [self.pop_output(r) for r in rids]

    @property
    def stats(self) -> dict:
        """Counters: prompt tokens served from the cache (``prefix_hit_tokens``)
        out of prompt tokens admitted (``prefix_query_tokens``), their ratio,
        pages, steps, preemptions and batch re-gathers."""
        cache = self.cache.stats
        out: dict[str, int | float] = dict(self._counters)
        q = out["prefix_query_tokens"]
        out["prefix_hit_rate"] = out["prefix_hit_tokens"] / q if q else 0.0
        out.update(num_pages=cache.num_pages, pages_used=cache.pages_used,
                   pages_free=cache.pages_free, pages_evictable=cache.pages_evictable,
                   num_running=len(self._running), num_waiting=len(self._waiting) +
                   len(self._incoming))
        return out

    # ------------------------------------------------------------- internals
    def _accept(self, req: _Request, logits: np.ndarray, events: dict,
                token: int | None = None) -> None:
        if token is None:
            token = sample(logits, req.params, req.rng)
        req.generated.append(token)
        events.setdefault(req.rid, []).append(token)
        self._counters["num_generated_tokens"] += 1
        if token in req.eos or len(req.generated) >= req.max_new_tokens:
            req.finished = True

    def _retire_finished(self) -> None:
        if any(r.finished for r in self._running):
            self._flush()
            for req in self._running:
                if req.finished:
                    self.cache.release(req.seq)
                    req.seq = None
            self._running = [r for r in self._running if not r.finished]

    def _preempt(self, req: _Request) -> None:
        self._flush()
        self._running.remove(req)
        self.cache.release(req.seq)   # its full pages stay cached for the recompute
        req.seq = None
        self._waiting.appendleft(req)
        self._counters["num_preemptions"] += 1

    def _forget_batch(self) -> None:
        self._runner.reset()
        self._batch_rids = None
        self._batch = []
        self._pending = 0

    def _requeue_running(self) -> None:
        """After a failed model call or write: every running request that is
        not finished goes back to the queue, to be recomputed; K/V not yet
        written is never indexed."""
        for req in reversed(self._running):
            if req.seq is not None and not req.seq.is_released:
                self.cache.release(req.seq)
            req.seq = None
            if not req.finished:
                self._waiting.appendleft(req)
        self._running = []
        self._forget_batch()

    def _flush(self) -> None:
        """Write the K/V of the batch's pending decode steps into the pages."""
        n = self._pending
        if not n:
            return
        cache = self.cache
        plan = cache.plan([r.seq for r in self._batch])   # n new tokens per sequence
        try:
            for layer, (k, v) in enumerate(self._runner.recent_kv(n)):
                cache.write(layer, plan, k, v)
        except BaseException:
            cache.discard(plan)
            self._requeue_running()
            raise
        self._pending = 0

    def _decode(self, events: dict) -> bool:
        """One token for every running request; returns whether any was preempted."""
        cache, preempted, page_size = self.cache, False, self.cache.page_size
        while self._running:
            # a sequence needs a page for its next token iff its pages are full:
            # the engine never forks, so no partly filled last page is shared
            needed = sum(1 for r in self._running if r.seq.num_tokens % page_size == 0)
            if needed <= cache.num_free_pages + cache.num_evictable_pages:
                break
            self._preempt(self._running[-1])   # youngest first: the oldest always advance
            preempted = True
        reqs = self._running
        if not reqs:
            return preempted
        # This runs once per token: plain Python for the batch's few numbers,
        # since each NumPy call here costs more than its work (the model has
        # just pushed the interpreter out of the CPU's caches).
        seqs = [r.seq for r in reqs]
        len_list = [s.num_tokens for s in seqs]
        rids = tuple(r.rid for r in reqs)
        if rids != self._batch_rids or self._runner.needs_gather(max(len_list)):
            self._flush()
            gather_plan = cache.plan(seqs)   # no new tokens: exactly the cached past
            remaining = max(r.max_new_tokens - len(r.generated) for r in reqs)
            capacity = max(len_list) + 1 + min(remaining, _MAX_HEADROOM)
            self._forget_batch()
            self._runner.start_batch(
                lambda layer, out: cache.gather(layer, gather_plan, "BHTD", out=out),
                np.array(len_list, dtype=np.int64), capacity)
            self._batch_rids, self._batch = rids, list(reqs)
            self._counters["num_regathers"] += 1
        lens = np.array(len_list, dtype=np.int64)
        tokens = np.array([r.generated[-1] for r in reqs], dtype=np.int64)
        cache.extend_batch(seqs, tokens)
        try:
            logits = self._runner.decode(tokens, lens)
        except BaseException:
            self._requeue_running()
            raise
        self._pending += 1
        self._counters["num_decode_steps"] += 1
        greedy = logits.argmax(axis=-1)      # one call for the batch's greedy rows
        for b, r in enumerate(reqs):
            self._accept(r, logits[b], events, int(greedy[b]) if r.rng is None else None)
        if self._pending >= self.write_interval:
            self._flush()
        self._retire_finished()
        return preempted

    def _admit(self, events: dict) -> None:
        cache = self.cache
        while self._waiting and len(self._running) < self.max_batch_size:
            req = self._waiting[0]
            tokens = req.all_tokens()
            seq = cache.add_sequence(tokens, salt=req.salt)
            num_cached = seq.num_cached_tokens
            needed = cache.num_pages_needed(seq, tokens.shape[0] - num_cached)
            # keep a page per running request so the next decode step rarely preempts
            if needed + len(self._running) > cache.num_free_pages + cache.num_evictable_pages:
                cache.release(seq)
                break
            self._waiting.popleft()
            past = None
            if num_cached:
                gather_plan = cache.plan([seq])
                past = [cache.gather(layer, gather_plan, "BHTD")
                        for layer in range(self.io.num_layers)]
            cache.extend(seq, tokens[num_cached:])
            plan = cache.plan([seq])
            try:
                logits, kv = self._runner.prefill(tokens[num_cached:], num_cached, past)
                for layer, (k, v) in enumerate(kv):
                    cache.write(layer, plan, k, v)
            except BaseException:
                cache.discard(plan)       # nothing of this prefill gets indexed
                cache.release(seq)
                self._waiting.appendleft(req)
                raise
            req.seq = seq
            self._running.append(req)
            self._counters["num_prefills"] += 1
            self._counters["prefix_hit_tokens"] += num_cached
            self._counters["prefix_query_tokens"] += tokens.shape[0]
            self._accept(req, logits, events)
            self._retire_finished()
