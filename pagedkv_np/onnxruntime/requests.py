"""A generation request inside :class:`~pagedkv_np.onnxruntime.OrtDecoder`, what
callers see of it, and what one step reports.

A request's life::

    queued ──admit──> running ──eos / max_new_tokens / abort / failure──> finished
       ^                 │
       └───preempted─────┘   (pages released; recomputed from its tokens)

A finished request keeps its tokens and its :class:`RequestStatus` until
``pop_output`` takes them.

Each token is chosen by :meth:`Request.choose` (penalties, masks, greedy or a
draw, the log-probabilities asked for, the grammar's step) and then taken by
:meth:`Request.accept`, which says whether the request ends. A request made
with ``n`` continuations carries the other ``n - 1`` in ``forks`` until its
prompt is computed; they then start from its pages (``PagedKVCache.fork``)
and its logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ..errors import ConfigError, DTypeError, RequestFailed
from ..checks import is_int
from .sampling import SamplingParams, TokenPenalties, log_softmax, sample, top_logprobs

__all__ = ["FINISH_REASONS", "RequestStatus", "StepEvents", "Request", "TokenLogprob",
           "make_rng", "check_request_id", "parse_eos"]

#: Why a request finished: an end token, its ``max_new_tokens``, ``abort``,
#: or a failure of one of its steps.
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class RequestStatus:
    """A snapshot of one request.

    Attributes
    ----------
    request_id : int
    finished : bool
    finish_reason : {None, "stop", "length", "abort", "error"}
        None while the request is queued or running.
    num_prompt_tokens : int
    num_cached_tokens : int
        Prompt tokens served from the prefix cache when the request was first
        admitted (0 before that).
    num_generated_tokens : int
    error : RequestFailed or None
        Why the request failed (``finish_reason == "error"``).
    """

    request_id: int
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    error: RequestFailed | None


class TokenLogprob(NamedTuple):
    """A generated token's log-probability and the best alternatives
    (:mod:`pagedkv_np.onnxruntime.sampling` says which distribution)."""

    token: int
    logprob: float
    #: up to the request's ``logprobs`` best ``(token id, logprob)``, best first
    top: list[tuple[int, float]]


class StepEvents(dict):
    """What one ``step()`` did: ``{request_id: [new token ids]}``, plus

    Attributes
    ----------
    finished : frozenset of int
        Requests that finished in this step, for any reason (failures
        included), and those aborted since the previous step.
    errors : dict of int to RequestFailed
        The requests of ``finished`` that failed, and why.
    statuses : dict of int to RequestStatus
        Each request of ``finished`` as it ended: finish reason, token
        counts (cached prompt tokens included), error.
    admitted : dict of int to int
        Requests first admitted in this step, and how many of their prompt
        tokens came from the prefix cache.
    logprobs : dict of int to list of TokenLogprob
        For the requests that asked for log-probabilities: one entry per
        new token of this step, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.finished: frozenset[int] = frozenset()
        self.errors: dict[int, RequestFailed] = {}
        self.statuses: dict[int, RequestStatus] = {}
        self.admitted: dict[int, int] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}

    def __repr__(self) -> str:
        return (f"StepEvents({dict.__repr__(self)}, finished={sorted(self.finished)}, "
                f"errors={sorted(self.errors)}, admitted={self.admitted})")


class Request:
    """A request's prompt, budget, sampler and progress (the engine's record).

    While running, every token but the last generated one has its K/V in the
    cache: ``seq.num_tokens == len(prompt) + len(generated) - 1``.
    ``isolate`` marks a request whose batch failed: its next decode step
    runs it alone, so that a failure there is its own.

    Parameters
    ----------
    prompt : ndarray, shape [n], int64
    max_new_tokens : int
    eos : frozenset of int
        The tokens that end the request (returned as its last token).
    params : SamplingParams
    rng : numpy.random.Generator or None
        None exactly when ``params`` is greedy.
    salt : optional
    min_tokens : int
        ``eos`` tokens are masked until this many tokens were generated.
    logprobs : int or None
        Alternatives to report per token (0: the chosen token's only);
        None: no log-probabilities.
    constraint : optional
        A grammar's per-request matcher (``pagedkv_np.constrain.Matcher``):
        ``mask(row)``, ``consume(token)``, ``stopped``.

    Attributes
    ----------
    fast_greedy : bool
        Greedy with nothing to apply: the batch's argmax is its token.
    """

    __slots__ = ("rid", "prompt", "max_new_tokens", "eos", "params", "rng", "salt",
                 "generated", "seq", "finish_reason", "error", "num_cached", "admitted",
                 "isolate", "min_tokens", "logprobs", "logprob_entries", "constraint",
                 "forks", "fast_greedy", "_plain_draw", "_penalties", "_end_ids", "_pending")

    def __init__(self, prompt: np.ndarray, max_new_tokens: int, eos: frozenset[int],
                 params: SamplingParams, rng: np.random.Generator | None, salt: Any, *,
                 min_tokens: int = 0, logprobs: int | None = None,
                 constraint: Any = None) -> None:
        self.rid = -1
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
        self.finish_reason: str | None = None
        self.error: RequestFailed | None = None
        self.num_cached = 0
        self.admitted = False
        self.isolate = False
        self.min_tokens = min_tokens if eos else 0   # nothing to mask without end tokens
        self.logprobs = logprobs
        self.logprob_entries: list[TokenLogprob] | None = None if logprobs is None else []
        self.constraint = constraint
        self.forks: list[Request] = []
        self._penalties = TokenPenalties(params, prompt) if params.changes_logits else None
        self._end_ids = np.array(sorted(eos), dtype=np.int64)
        self._pending: TokenLogprob | None = None
        plain = (self._penalties is None and not self.min_tokens and logprobs is None
                 and constraint is None)
        self.fast_greedy = plain and params.greedy
        self._plain_draw = plain and not params.greedy

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def all_tokens(self) -> np.ndarray:
        """int64 [len(prompt) + len(generated)]: what a recompute feeds."""
        if not self.generated:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.generated, dtype=np.int64)])

    def status(self) -> RequestStatus:
        return RequestStatus(self.rid, self.finished, self.finish_reason,
                             int(self.prompt.shape[0]), self.num_cached,
                             len(self.generated), self.error)

    def choose(self, logits: np.ndarray) -> int:
        """The next token from this request's row of logits (shape
        [vocab_size], float): penalties and bias, the ``min_tokens`` mask,
        the grammar's mask, then greedy or a draw; the grammar takes the
        token. Call :meth:`accept` with it next.

        Raises
        ------
        ConfigError
            The masks leave no token (a grammar that cannot go on), or a
            ``logit_bias`` id is outside the row.
        """
        if self._plain_draw:
            return sample(logits, self.params, self.rng)
        row = logits.astype(np.float64)
        if self._penalties is not None:
            self._penalties.apply(row)
        if self.min_tokens and len(self.generated) < self.min_tokens:
            row[self._end_ids[self._end_ids < row.shape[0]]] = -math.inf
        if self.constraint is not None:
            self.constraint.mask(row)
        if not row.max() > -math.inf:
            raise ConfigError("Invalid constraint: no token is allowed at this point "
                              f"(token {len(self.generated)} of the request)")
        token = int(np.argmax(row)) if self.params.greedy else sample(row, self.params, self.rng)
        if self.logprobs is not None:
            lp = log_softmax(row)
            self._pending = TokenLogprob(token, float(lp[token]), top_logprobs(lp, self.logprobs))
        if self.constraint is not None:
            self.constraint.consume(token)
        return token

    def accept(self, token: int, events: StepEvents) -> str | None:
        """Take ``token`` as generated (and report it, with its
        log-probabilities, in ``events``); returns the finish reason it brings
        (an end token or a grammar that is complete: ``"stop"``; the budget
        spent: ``"length"``), else None."""
        self.generated.append(token)
        events.setdefault(self.rid, []).append(token)
        if self._penalties is not None:
            self._penalties.add(token)
        if self.logprob_entries is not None and self._pending is not None:
            self.logprob_entries.append(self._pending)
            events.logprobs.setdefault(self.rid, []).append(self._pending)
            self._pending = None
        if token in self.eos or (self.constraint is not None and self.constraint.stopped):
            return "stop"
        if len(self.generated) >= self.max_new_tokens:
            return "length"
        return None

    @property
    def width(self) -> int:
        """Sequences the request runs once admitted: itself and its forks."""
        return 1 + len(self.forks)

    def hand_over_forks(self) -> list[Request]:
        """This request ended: if that was before its prompt was computed,
        the first of its unfinished forks takes the others over and is
        returned (to be queued in its place); else nothing."""
        left = [r for r in self.forks if not r.finished]
        self.forks = []
        if left:
            left[0].forks = left[1:]
        return left[:1]

    def start_forks(self, fork_seq: Callable[[], Any], logits: np.ndarray,
                    events: StepEvents) -> Iterator[tuple[Request, int, Exception | None]]:
        """This request's prompt is computed (its pages written, ``logits``
        its last row): each unfinished fork takes a sequence of its own
        sharing those pages (``fork_seq()``) and chooses its first token.
        Yields ``(fork, token, None)``, or ``(fork, -1, error)`` for a fork
        that failed to start."""
        forks, self.forks = self.forks, []
        for fork in forks:
            if fork.finished:           # aborted while it waited
                continue
            try:
                token = fork.choose(logits)
                fork.seq = fork_seq()
            except Exception as exc:
                yield fork, -1, exc
                continue
            fork.admitted, fork.num_cached = True, self.num_cached
            events.admitted[fork.rid] = self.num_cached
            yield fork, token, None


def make_rng(seed: Any) -> np.random.Generator:
    """A request's own generator from its ``seed``, else a typed error."""
    if isinstance(seed, (np.random.Generator, np.random.BitGenerator)):
        # default_rng would hand back the caller's own generator, whose
        # draws the caller could then advance under the request
        raise DTypeError("Invalid seed: expected an int, SeedSequence or None, not a "
                         "generator shared with the caller")
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"Invalid seed: expected an int, SeedSequence or None ({exc})") from None


def spawn_seeds(temperature: Any, seed: Any, n: int) -> list:
    """Seeds of ``n`` requests made together: ``SeedSequence(seed).spawn(n)``
    when sampling, else None each (greedy requests draw nothing)."""
    if not temperature:
        return [None] * n
    try:
        return list(np.random.SeedSequence(seed).spawn(n))
    except (TypeError, ValueError) as exc:
        raise DTypeError(f"Invalid seed: {exc}") from None


def check_request_id(request_id: Any) -> int:
    """``request_id`` as an int, else a typed error."""
    if not is_int(request_id):
        raise DTypeError(f"Invalid request_id: expected an integer, got "
                         f"{type(request_id).__name__}")
    return int(request_id)


def parse_eos(eos: Any, name: str = "eos_token_id") -> frozenset:
    """``eos`` (an ``eos_token_id`` or ``stop_token_ids``, named by ``name``)
    as a set of token ids (None: none), else a typed error."""
    if eos is None:
        return frozenset()
    if isinstance(eos, (str, bytes)):
        raise DTypeError(f"Invalid {name}: expected an integer or integers, "
                         f"got {type(eos).__name__}")
    try:
        items = [eos] if is_int(eos) else list(eos)
    except TypeError:
        raise DTypeError(f"Invalid {name}: expected an integer or integers, "
                         f"got {type(eos).__name__}") from None
    for t in items:
        if not is_int(t):
            raise DTypeError(f"Invalid {name}: expected integers, got {t!r}")
        if t < 0:
            raise ConfigError(f"Invalid {name}: token id {t} is negative")
    return frozenset(int(t) for t in items)
