"""What a caller may ask of :class:`~pagedkv_np.onnxruntime.OrtDecoder`'s
requests: sampling and penalties, end tokens, log-probabilities, a grammar,
``n`` continuations of one prompt; every option is checked, with a typed
error naming it, before anything is queued.

The engine's batching loop (:mod:`pagedkv_np.onnxruntime.batching`) runs the
requests; what each one does with its row of logits is
:meth:`Request.choose <pagedkv_np.onnxruntime.requests.Request.choose>`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, DTypeError, TextUnavailable
from ..checks import check_nonneg_int, check_positive_int, is_int, shown
from ..prefix import encode_salt
from ..tokens import as_tokens
from .requests import (Request, StepEvents, TokenLogprob, make_rng, parse_eos,
                       spawn_seeds)
from .sampling import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:   # the grammar engine is an optional extra
    from ..constrain import Constraint, GrammarTokenizer

__all__ = ["RequestAPI"]

_GRAMMAR_LOCK = threading.Lock()   # one build of a decoder's grammar tokenizer at a time


class RequestAPI:
    """Queueing requests, for :class:`OrtDecoder` (which provides the
    attributes and the step, output and abort methods named below)."""

    io: Any
    eos_token_ids: frozenset
    text: Any
    max_batch_size: int
    _lock: Any
    _step_lock: Any
    _requests: dict[int, Request]
    _incoming: Any
    _batcher: Any
    _ids: Any
    _grammar: GrammarTokenizer | None = None

    if TYPE_CHECKING:
        def step(self) -> StepEvents: ...

        def settle(self) -> None: ...

        def pop_output(self, request_id: int) -> list[int]: ...

        def abort(self, request_id: int) -> None: ...

        def check_request(self, num_prompt_tokens: int, max_new_tokens: int) -> None: ...

        def _get(self, request_id: Any) -> Request: ...

    # ------------------------------------------------------------- queueing
    def add_request(self, prompt: Any, max_new_tokens: int = 64, *, eos_token_id: Any = None,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: Any = None, salt: Any = None, min_p: float = 0.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    repetition_penalty: float = 1.0, logit_bias: dict | None = None,
                    stop_token_ids: Any = None, ignore_eos: bool = False, min_tokens: int = 0,
                    logprobs: int | None = None, constraint: Constraint | None = None) -> int:
        """Queue a request; returns its id. Thread-safe.

        Parameters
        ----------
        prompt : sequence of int, length >= 1
            Token ids in ``[0, vocab_size)``; copied, so the caller may reuse
            its buffer at once.
        max_new_tokens : int
            Stop after this many generated tokens.
        eos_token_id : int or iterable of int, optional
            The end tokens, instead of the decoder's; an end token is returned
            as the last generated token.
        temperature, top_k, top_p, min_p : see :class:`SamplingParams`
            ``temperature=0`` (the default) is greedy.
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias
            See :mod:`pagedkv_np.onnxruntime.sampling` (formulas and order).
        seed : int or numpy SeedSequence, optional
            Seed of this request's sampler.
        salt : str, bytes or int, optional
            Requests share cached pages only with requests of the same salt.
        stop_token_ids : int or iterable of int, optional
            More tokens that end the request, also with ``ignore_eos``.
        ignore_eos : bool
            The end tokens (``eos_token_id``) do not end the request.
        min_tokens : int
            Tokens that end the request are masked until this many were
            generated (at most ``max_new_tokens``).
        logprobs : int, optional
            Report each generated token's log-probability and this many best
            alternatives (0 to 20) in the steps' ``logprobs`` and in
            :meth:`get_logprobs`.
        constraint : Constraint, optional
            A grammar the output must follow (:meth:`make_constraint`); the
            request ends with ``"stop"`` once the grammar is complete.

        Raises
        ------
        DTypeError, ShapeError
            The prompt is not a 1-D sequence of integers, or is empty; an
            option has the wrong type.
        ConfigError
            A token id (prompt, ``logit_bias``, ``stop_token_ids``) is outside
            the vocabulary, an option is out of range, or the prompt plus
            ``max_new_tokens`` cannot fit the pool (or ``max_positions``).
        """
        req = self._new_request(
            prompt, max_new_tokens, seed, eos_token_id=eos_token_id, temperature=temperature,
            top_k=top_k, top_p=top_p, salt=salt, min_p=min_p, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
            logit_bias=logit_bias, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            min_tokens=min_tokens, logprobs=logprobs, constraint=constraint)
        self._enqueue([req])
        return req.rid

    def add_parallel_requests(self, prompt: Any, n: int, max_new_tokens: int = 64, *,
                              seed: Any = None, **options: Any) -> list[int]:
        """Queue ``n`` continuations of one prompt; returns their ids.

        The prompt is computed once: the continuations start from its pages
        (shared copy-on-write, :meth:`PagedKVCache.fork`) and its last
        logits, each with its own sampler, seeded from
        ``SeedSequence(seed).spawn(n)`` as :meth:`generate` seeds ``n``
        prompts, and its own matcher of ``constraint``. Each is then a
        request of its own (``get_output``, ``abort``, ``status``...).

        Parameters
        ----------
        n : int
            1 to ``max_batch_size``.
        **options
            Those of :meth:`add_request`.
        """
        n = check_positive_int(n, "n")
        if n > self.max_batch_size:
            raise ConfigError(f"Invalid n: expected at most max_batch_size "
                              f"({self.max_batch_size}) continuations, got {n}")
        seeds = spawn_seeds(options.get("temperature", 0.0), seed, n)
        first = self._new_request(prompt, max_new_tokens, seeds[0], **options)
        others = [self._new_request(first.prompt, max_new_tokens, s, **options)
                  for s in seeds[1:]]
        first.forks = others
        self._enqueue([first], held=others)
        return [first.rid] + [r.rid for r in others]

    def _new_request(self, prompt: Any, max_new_tokens: Any, seed: Any, *,
                     eos_token_id: Any = None, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, salt: Any = None, min_p: float = 0.0,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     repetition_penalty: float = 1.0, logit_bias: Any = None,
                     stop_token_ids: Any = None, ignore_eos: Any = False, min_tokens: Any = 0,
                     logprobs: Any = None, constraint: Any = None) -> Request:
        """A checked request, not yet queued (see :meth:`add_request`)."""
        tokens = as_tokens(prompt, "prompt", allow_empty=False)   # a copy of its own
        encode_salt(salt)
        max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
        vocab = self.io.vocab_size
        if vocab is not None and int(tokens.max()) >= vocab:
            raise ConfigError(f"Invalid prompt: token id {int(tokens.max())} is outside the "
                              f"model's vocabulary [0, {vocab})")
        self.check_request(tokens.shape[0], max_new_tokens)
        params = SamplingParams(temperature, top_k, top_p, min_p, presence_penalty,
                                frequency_penalty, repetition_penalty, logit_bias)
        if vocab is not None:
            params.check_vocab(vocab)
        if not isinstance(ignore_eos, bool):
            raise DTypeError(f"Invalid ignore_eos: expected a bool, got "
                             f"{type(ignore_eos).__name__}")
        eos = self.eos_token_ids if eos_token_id is None else parse_eos(eos_token_id)
        stops = parse_eos(stop_token_ids, "stop_token_ids")
        if vocab is not None and stops and max(stops) >= vocab:
            raise ConfigError(f"Invalid stop_token_ids: token id {max(stops)} is outside the "
                              f"model's vocabulary [0, {vocab})")
        min_tokens = check_nonneg_int(min_tokens, "min_tokens")
        if min_tokens > max_new_tokens:
            raise ConfigError(f"Invalid min_tokens: expected at most max_new_tokens "
                              f"({max_new_tokens}), got {min_tokens}")
        if logprobs is not None:
            if not is_int(logprobs):
                raise DTypeError(f"Invalid logprobs: expected an integer or None, got "
                                 f"{type(logprobs).__name__}")
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise ConfigError(f"Invalid logprobs: expected 0 to {MAX_LOGPROBS} "
                                  f"alternatives, got {shown(logprobs)}")
            logprobs = int(logprobs)
        matcher = None if constraint is None else self._check_constraint(constraint).start()
        rng = None if params.greedy else make_rng(seed)
        return Request(tokens, max_new_tokens, (frozenset() if ignore_eos else eos) | stops,
                       params, rng, salt, min_tokens=min_tokens, logprobs=logprobs,
                       constraint=matcher)

    def _check_constraint(self, constraint: Any) -> Constraint:
        from ..constrain import Constraint

        if not isinstance(constraint, Constraint):
            raise DTypeError(f"Invalid constraint: expected a Constraint "
                             f"(decoder.make_constraint), got {type(constraint).__name__}")
        vocab = self.io.vocab_size
        if vocab is not None and constraint.vocab_size != vocab:
            raise ConfigError(f"Invalid constraint: built for a vocabulary of "
                              f"{constraint.vocab_size} tokens, the model has {vocab}")
        return constraint

    def _enqueue(self, reqs: list[Request], held: Iterable[Request] = ()) -> None:
        """Give ids to ``reqs`` and queue them; ``held`` get ids and are
        known (status, output, abort) but wait inside another request."""
        with self._lock:
            for req in [*reqs, *held]:
                req.rid = next(self._ids)
                self._requests[req.rid] = req
            self._incoming.extend(reqs)

    # -------------------------------------------------------------- grammars
    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """This decoder's vocabulary for grammars, built on first use (about
        2 s for 49,152 tokens) from its tokenizer, its logits' width and its
        end tokens.

        Raises
        ------
        TextUnavailable
            The decoder has no tokenizer.
        ImportError
            The ``constrain`` extra is not installed.
        """
        if self._grammar is None:
            from ..constrain import GrammarTokenizer

            if self.text is None:
                raise TextUnavailable("this decoder has no tokenizer, which a grammar needs: "
                                      "build it with OrtDecoder.from_pretrained(...)")
            with _GRAMMAR_LOCK:
                if self._grammar is None:
                    self._grammar = GrammarTokenizer.from_codec(
                        self.text, self.io.vocab_size,
                        self.eos_token_ids or None)
        return self._grammar

    def make_constraint(self, kind: str, spec: Any = None, **options: Any) -> Constraint:
        """A grammar over this decoder's vocabulary, for ``add_request(...,
        constraint=...)``; reusable by any number of requests.

        Parameters
        ----------
        kind : {"json_schema", "json_object", "regex", "lark"}
        spec : dict or str, optional
            The JSON schema (a dict or its text), the regular expression or
            the Lark grammar; none for ``"json_object"``.
        **options
            ``whitespace_flexible`` for the JSON kinds
            (:class:`~pagedkv_np.constrain.Constraint`).

        Raises
        ------
        ConfigError
            An unknown kind, or a grammar that does not compile (the message
            says where).
        """
        from ..constrain import Constraint

        return Constraint.build(self.grammar_tokenizer, kind, spec, **options)

    # ---------------------------------------------------------------- output
    def get_logprobs(self, request_id: int) -> list[TokenLogprob]:
        """Log-probabilities of the tokens generated so far (a copy), for a
        request that asked for them (``logprobs=``)."""
        req = self._get(request_id)
        if req.logprob_entries is None:
            raise ConfigError(f"Invalid request_id: request {request_id} did not ask for "
                              f"logprobs")
        return list(req.logprob_entries)

    # ---------------------------------------------------------------- blocking
    def generate(self, prompts: Iterable[Any], max_new_tokens: int = 64, *,
                 temperature: float = 0.0, seed: Any = None,
                 **options: Any) -> list[list[int]]:
        """Generate for every prompt; returns the new tokens of each, in order.

        With sampling, request ``i`` is seeded from ``SeedSequence(seed).spawn``,
        so the result does not depend on batching or preemption. Requests
        queued with :meth:`add_request` advance meanwhile; their tokens are in
        :meth:`get_output` and their finishes in the next :meth:`step`'s
        ``finished``. ``options`` are those of :meth:`add_request`.

        Raises
        ------
        RequestFailed
            One of the requests failed (``__cause__`` says why); the call's
            other requests were aborted and all of them forgotten.
        """
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise DTypeError(f"Invalid prompts: expected a list of token id sequences, "
                             f"got {type(prompts).__name__}")
        try:
            prompts = list(prompts)
        except TypeError:   # a 0-d array has __iter__ but cannot be iterated
            raise DTypeError(f"Invalid prompts: expected a list of token id sequences, "
                             f"got {type(prompts).__name__}") from None
        seeds = spawn_seeds(temperature, seed, len(prompts))
        # every prompt is checked before any is queued
        reqs = [self._new_request(p, max_new_tokens, s, temperature=temperature, **options)
                for p, s in zip(prompts, seeds)]
        with self._step_lock:
            self._enqueue(reqs)
            mine = {r.rid for r in reqs}
            try:
                while not all(r.finished for r in reqs):
                    failed = next((r for r in reqs if r.error is not None), None)
                    if failed is not None:
                        raise failed.error   # type: ignore[misc]
                    events = self.step()
                    # other requests advance too: their finishes are reported
                    # by the next step() of whoever drives them
                    self._batcher.finished_log.extend(
                        self._requests[rid] for rid in events.finished
                        if rid not in mine and rid in self._requests)
                failed = next((r for r in reqs if r.error is not None), None)
                if failed is not None:
                    raise failed.error   # type: ignore[misc]
                self.settle()      # their K/V into the pages, now
            except BaseException:
                self._forget(reqs)
                raise
            return [self.pop_output(r.rid) for r in reqs]

    def _forget(self, reqs: list[Request]) -> None:
        """Abort what is left of ``reqs`` and forget them all (a failed generate)."""
        for req in reqs:
            if not req.finished:
                self.abort(req.rid)
        with self._lock:
            for req in reqs:
                self._requests.pop(req.rid, None)
        log = self._batcher.finished_log
        log[:] = [r for r in log if r not in reqs]
