"""OrtDecoder: continuous batching over an ONNX decoder, K/V kept in a PagedKVCache.

One :meth:`OrtDecoder.step` decodes a token for every running request, then
admits and prefills waiting ones (:mod:`pagedkv_np.onnxruntime.batching`
says how, and what a preemption does).

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
  prompt needs no padding. A long prompt is fed in chunks, one a step
  between the decode steps of the running requests (``prefill_chunk``),
  continuing in the runner's buffers; a graph built by
  :mod:`pagedkv_np.models.graph` computes logits for the last position only
  (its ``logits_to_keep`` input), others for every position of a chunk.

When a step fails, only the requests it concerns end (with
``finish_reason == "error"`` and a :class:`~pagedkv_np.errors.RequestFailed`
in :meth:`OrtDecoder.status` and in the step's ``errors``), and the engine
keeps serving the others: see :mod:`pagedkv_np.onnxruntime.batching`.

Thread safety: :meth:`add_request` and the read-only methods may be called
from any thread; ``step``, ``generate`` and ``abort`` are serialised by a lock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
from typing import Any

from ..cache import PagedKVCache
from ..errors import ConfigError, DTypeError, PagedKVError
from ..checks import check_positive_int, shown
from ..layout import resolve_dtype
from ..memory import trim_heap
from ..quant import resolve_quant
from ..tiers.fingerprint import model_fingerprint, weights_digest
from ..threads import thread_budget
from ..tiers.manager import flat_stats
from .batching import Batcher
from .chunking import ChunkBudget
from .decode_choice import engine_head, from_gguf, native_decode_step
from .limits import RequestLimits
from .model_io import discover, graph_facts
from .request_api import RequestAPI
from .requests import Request, RequestStatus, StepEvents, check_request_id, parse_eos
from .runners import Runner, make_runner
from .session import load_model, make_session
from .textgen import TextGenerationMixin

__all__ = ["OrtDecoder", "RequestNotFound"]


def _model_name(model: Any, model_folder: Any) -> str:
    """What the repr calls the model: the GGUF file a folder was imported
    from, else the folder's or file's name, else the type of what was given."""
    if model_folder is not None:
        imported = model_folder.config.get("pagedkv_np", {})
        return str(imported.get("source") or os.path.basename(model_folder.path))
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        return os.path.basename(os.fspath(model))
    return f"<{type(model).__name__}>"


class RequestNotFound(PagedKVError, KeyError):
    """No request with that id (never added, or its output was already taken)."""


class OrtDecoder(RequestAPI, TextGenerationMixin):
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
    kv_dtype : {None, "int8"} or the model's K/V dtype, optional
        dtype of the pages: the model's K/V dtype (the default) or
        ``"int8"``, which holds 3.5x the tokens of float32 pages (see
        :mod:`pagedkv_np.quant`).
    enable_prefix_caching : bool
        When False, every prompt is computed in full (for comparison).
    partial_page_reuse : bool
        Also reuse a shared prefix that ends inside a page (see
        :class:`~pagedkv_np.PagedKVCache`).
    write_interval : int
        Decode steps whose K/V stays in the model's buffers before it is
        written into the pages, in one call per layer (sooner when the batch
        changes or a request ends). 1 writes every step.
    prefill_chunk : int, optional
        Prompt tokens a step feeds while other requests decode (default
        :data:`~pagedkv_np.onnxruntime.chunking.DEFAULT_PREFILL_CHUNK`): a
        long prompt is fed in chunks between their decode steps, so that
        they do not stall for its whole prefill. Smaller chunks keep their
        gaps shorter, larger ones the prompt's own wait; see
        :mod:`pagedkv_np.onnxruntime.chunking`.
    family : {"auto", "optimum", "gqa"}
    num_kv_heads, head_dim : int, optional
        For models whose past inputs leave these dimensions symbolic.
    max_positions : int, optional
        Most positions a request may use (prompt + ``max_new_tokens - 1``),
        such as the context length of the model's configuration. The graph's
        own limit (the rows of its position or rotary table) applies too:
        the smaller one is :attr:`max_positions`.
    threads, spin : optional
        Cores shared by onnxruntime and the cache's kernels (default: the
        CPU affinity's), and whether idle onnxruntime threads spin (default:
        50 us at most): :func:`pagedkv_np.threads.thread_budget`, README "Threads".
    session_options : onnxruntime.SessionOptions, optional
        Used as they are: then only a ThreadBudget as ``threads`` may be
        given, for the kernels.
    providers : list, optional
        Default ``["CPUExecutionProvider"]``.
    native_decode : bool, optional
        Decode steps through the engine's own kernels
        (:mod:`pagedkv_np.onnxruntime.native`) instead of the graph: needs a
        graph built by :mod:`pagedkv_np.models.graph` (it carries its
        geometry) of the ``"gqa"`` family on the CPU provider. Default: where
        it can and its products take int8 activations (see
        ``int8_activations``: by default those of a GGUF import); with
        float32 ones onnxruntime's products are faster, so True is for
        comparing the two.
    int8_activations : bool, optional
        The engine's decode step multiplies block weights by activations
        rounded to int8 per block (as llama.cpp does): faster, not exact,
        deterministic (:mod:`pagedkv_np.backends.block_q8`; a request's
        tokens do not depend on its batch, chunks or cached prefix). True:
        an LM head the engine runs too. Default (None): where the engine's
        decode step runs on a model imported from a GGUF file (an
        engine-side head's rows rounded to int8 twice, the row then what
        that left: near float32's values at int8's speed, see
        :func:`~pagedkv_np.backends.block_q8_tiles.q8x2_tiled_matmul`), or
        the graph's own block products take int8 activations (every
        MatMulNBits node at ``accuracy_level=4``; the head too).
        SmolLM2-135M Q4_1 on 58 windows of 512 tokens of the license texts
        (``scripts/bench_accuracy.py decode``, tiled products): NLL 2.72845
        with float32 activations, 2.73088 (+0.089%) by default (the same
        with an exact head), 2.73106 (+0.096%) with True; llama.cpp's
        ``llama-perplexity`` on the same file and text 2.73090 (on the
        weights in float32, a file written for the check: 2.72845, as
        here). False: float32 throughout.
    text : TextCodec, optional
        The tokenizer and chat template for the text methods
        (:class:`~pagedkv_np.onnxruntime.textgen.TextGenerationMixin`).
    model_folder : ModelFolder, optional
        The folder the model was read from (set by :meth:`from_pretrained`).
    disk_cache, disk_cache_bytes, redis_url, hash_secret, tier_options : optional
        Storage tiers below RAM (see :class:`~pagedkv_np.PagedKVCache` and
        :mod:`pagedkv_np.tiers`); their keys carry a fingerprint of the model
        file(s), hashed once and remembered in the disk tier's directory.

    Attributes
    ----------
    io : ModelIO
        What was read from the model.
    max_positions : int or None
        Positions a request may use; None when neither the graph nor the
        caller sets a limit.
    context_length : int
        The model's positions (``max_positions``), or the pool's tokens for
        a model without a limit (see :meth:`check_request`).
    limits : RequestLimits
        What one request may hold (``limits.room(n)``: most new tokens after
        a prompt of ``n``).
    cache : PagedKVCache
    session : onnxruntime.InferenceSession
    native : NativeDecode or None
        The engine's own decode step (None: the graph decodes); its ``int8``
        says whether it rounds activations to int8.
    threads : ThreadBudget
        onnxruntime's threads, and the kernels' in :meth:`step` and :meth:`abort`.
    """

    def __init__(self, model: Any, *, num_pages: int = 512, page_size: int = 16,
                 max_batch_size: int = 8, eos_token_id: Any = None, backend: str = "auto",
                 layout: str = "HND", enable_prefix_caching: bool = True,
                 partial_page_reuse: bool = True, write_interval: int = 16,
                 prefill_chunk: int | None = None, family: str = "auto",
                 num_kv_heads: int | None = None,
                 head_dim: int | None = None, max_positions: int | None = None,
                 session_options: Any = None, threads: Any = None, spin: Any = None,
                 providers: list | None = None, disk_cache: Any = None,
                 disk_cache_bytes: int | None = None, redis_url: str | None = None,
                 hash_secret: bytes | None = None, tier_options: dict | None = None,
                 kv_dtype: Any = None, native_decode: bool | None = None,
                 int8_activations: bool | None = None, text: Any = None,
                 model_folder: Any = None) -> None:
        self.max_batch_size = check_positive_int(max_batch_size, "max_batch_size")
        self.write_interval = check_positive_int(write_interval, "write_interval")
        chunks = ChunkBudget(prefill_chunk)
        if max_positions is not None:
            max_positions = check_positive_int(max_positions, "max_positions")
        self.eos_token_ids = parse_eos(eos_token_id)
        self.text = text
        self.model_folder = model_folder
        self.threads = thread_budget(threads, spin, session_options=session_options)
        source, proto = load_model(model)
        self._model_name = _model_name(model, model_folder)
        facts = graph_facts(proto)
        weights = (weights_digest(source, proto, disk_cache)
                   if disk_cache is not None or redis_url is not None else None)
        self.native = native = native_decode_step(native_decode, source, proto, facts, family,
                                              providers, self.threads.threads, int8_activations,
                                              from_gguf(model_folder))
        del proto
        options = self.threads.session_options(session_options)
        self.session = make_session(source, options, providers)
        self.io = discover(self.session.get_inputs(), self.session.get_outputs(), facts,
                           family=family, num_kv_heads=num_kv_heads, head_dim=head_dim)
        head = None
        if facts.head_file is not None:
            # int8 activations for the head too only where asked (or the graph's
            # products take them); behind the int8 step by default, rounded twice
            # (int8x2): float32's likelihood at int8's speed (see int8_activations)
            int8_step = native is not None and native.int8
            head_int8 = int8_step and (int8_activations is True or facts.int8_matmuls)
            head = engine_head(source, facts.head_file, self.threads.threads, head_int8,
                                int8_step and not head_int8)
            self.io = dataclasses.replace(self.io, vocab_size=head.vocab_size)
            if native is not None:
                native.share_embedding(head.weight)      # a tied head: one copy of its blocks
                head.follow(native.threads_now)          # the step's thread count
        io = self.io
        limits = [n for n in (io.max_positions, max_positions) if n is not None]
        self.max_positions: int | None = min(limits) if limits else None
        if kv_dtype is not None and resolve_quant(kv_dtype) is None \
                and resolve_dtype(kv_dtype, "kv_dtype") != io.dtype:
            # the model's K/V are written and read back as they are
            raise DTypeError(f"Invalid kv_dtype: the model's K/V are {io.dtype}, so pages "
                             f"hold {io.dtype} or int8, got {kv_dtype!r}")
        self.cache = PagedKVCache(io.num_layers, num_pages, page_size, io.num_kv_heads,
                                  io.head_dim, dtype=io.dtype if kv_dtype is None else kv_dtype,
                                  layout=layout, backend=backend,
                                  enable_prefix_caching=enable_prefix_caching,
                                  partial_page_reuse=partial_page_reuse,
                                  disk_cache=disk_cache, disk_cache_bytes=disk_cache_bytes,
                                  redis_url=redis_url, hash_secret=hash_secret,
                                  tier_options=tier_options,
                                  model_id=weights and model_fingerprint(weights, io))
        self.limits = RequestLimits(self.max_positions, self.cache.num_pages,
                                    self.cache.page_size)
        self._lock = threading.Lock()          # guards _incoming, _requests
        self._step_lock = threading.RLock()    # serialises steps
        self._ids = itertools.count()
        self._incoming: collections.deque[Request] = collections.deque()
        self._requests: dict[int, Request] = {}
        self._counters = dict.fromkeys(
            ("prefix_hit_tokens", "prefix_query_tokens", "num_prefills",
             "num_prefill_chunks", "num_decode_steps",
             "num_generated_tokens", "num_preemptions", "num_regathers",
             "num_failed_requests", "num_batch_failures"), 0)
        self._batcher = Batcher(self.cache, make_runner(self.session, io, head, native),
                                self.max_batch_size, self.write_interval, self.max_positions,
                                self._counters, chunks,
                                two_fed=native is not None and native.int8)
        trim_heap()     # what loading read and copied into other layouts, freed

    def __repr__(self) -> str:
        cache = self.cache
        return (f"OrtDecoder(model={self._model_name!r}, context={self.context_length}, "
                f"pool={cache.num_pages} pages x {cache.page_size} tokens "
                f"({cache.dtype}, {cache.layout.value}), backend={cache.backend.name!r}, "
                f"max_batch_size={self.max_batch_size})")

    @property
    def _runner(self) -> Runner:
        """The runner that feeds the model (replaceable, as tests do)."""
        return self._batcher.runner

    @_runner.setter
    def _runner(self, runner: Runner) -> None:
        self._batcher.runner = runner

    # ------------------------------------------------------------- requests
    @property
    def context_length(self) -> int:
        """The model's positions (:attr:`max_positions`), or the pool's tokens
        when the model sets no limit."""
        return self.limits.context_length

    def check_request(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise :class:`~pagedkv_np.errors.ContextLengthExceeded` unless a
        request of this size fits the model and the pool: the one rule for the
        library and the server (:class:`~pagedkv_np.onnxruntime.limits.RequestLimits`)."""
        self.limits.check(num_prompt_tokens, max_new_tokens)

    def is_finished(self, request_id: int) -> bool:
        return self._get(request_id).finished

    def status(self, request_id: int) -> RequestStatus:
        """Where a request stands: finished or not, why, token counts, its error."""
        return self._get(request_id).status()

    def get_output(self, request_id: int) -> list[int]:
        """Tokens generated so far for a request (a copy)."""
        return list(self._get(request_id).generated)

    def pop_output(self, request_id: int) -> list[int]:
        """The tokens of a finished request (a failed one too); forgets the request."""
        request_id = check_request_id(request_id)
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise RequestNotFound(f"Invalid request_id: no request {shown(request_id)}")
            if not req.finished:
                raise ConfigError(f"Invalid request_id: request {request_id} is not finished")
            del self._requests[request_id]
        return req.generated

    def abort(self, request_id: int) -> None:
        """Stop a request now; its pages go back to the pool (full ones stay cached).

        An aborted request is listed in the ``finished`` of the next step.
        """
        with self._step_lock, self.threads.kernels():
            req = self._get(request_id)
            if req.finished:
                return
            with self._lock:
                if req in self._incoming:
                    self._incoming.remove(req)
            self._batcher.abort(req)

    def settle(self) -> None:
        """Write the K/V of the requests that finished in the last step into
        the pages now and release theirs. A step does it first, so that a
        request's last token does not wait for it; call this when no step
        follows soon (the blocking calls do, before they return)."""
        with self._step_lock, self.threads.kernels():
            self._batcher.settle()

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            batcher = self._batcher
            # retiring: finished, their K/V written into the pages by the next step
            return bool(self._incoming or batcher.waiting or batcher.running
                        or batcher.prefilling is not None or batcher.retiring)

    def _get(self, request_id: Any) -> Request:
        req = self._requests.get(check_request_id(request_id))
        if req is None:
            raise RequestNotFound(f"Invalid request_id: no request {shown(request_id)}")
        return req

    # ----------------------------------------------------------------- steps
    def step(self) -> StepEvents:
        """Run one decode step for the batch, then admit and prefill waiting requests.

        Returns
        -------
        StepEvents
            A dict ``{request_id: [new token ids]}`` for every request that
            produced tokens in this step, with ``finished`` (the requests
            that ended, for any reason) and ``errors`` (those that failed,
            with a :class:`~pagedkv_np.errors.RequestFailed` each).
        """
        with self._step_lock, self.threads.kernels():
            with self._lock:
                self._batcher.waiting.extend(self._incoming)
                self._incoming.clear()
            return self._batcher.step()

    @property
    def stats(self) -> dict:
        """Counters: prompt tokens served from the cache (``prefix_hit_tokens``)
        out of prompt tokens admitted (``prefix_query_tokens``), their ratio,
        pages, steps, preemptions, batch re-gathers, failed requests and
        failed batch steps."""
        cache = self.cache.stats
        out: dict[str, int | float] = dict(self._counters)
        q = out["prefix_query_tokens"]
        out["prefix_hit_rate"] = out["prefix_hit_tokens"] / q if q else 0.0
        out.update(num_pages=cache.num_pages, pages_used=cache.pages_used,
                   pages_free=cache.pages_free, pages_evictable=cache.pages_evictable,
                   num_running=len(self._batcher.running)
                   + (self._batcher.prefilling is not None),
                   num_waiting=len(self._batcher.waiting) + len(self._incoming))
        out.update(flat_stats(self.cache.tiers))
        return out
