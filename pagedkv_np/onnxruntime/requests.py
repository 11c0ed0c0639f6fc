"""A generation request inside :class:`~pagedkv_np.onnxruntime.OrtDecoder`, what
callers see of it, and what one step reports.

A request's life::

    queued ──admit──> running ──eos / max_new_tokens / abort / failure──> finished
       ^                 │
       └───preempted─────┘   (pages released; recomputed from its tokens)

A finished request keeps its tokens and its :class:`RequestStatus` until
``pop_output`` takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DTypeError, RequestFailed
from ..checks import is_int
from .sampling import SamplingParams

__all__ = ["FINISH_REASONS", "RequestStatus", "StepEvents", "Request", "make_rng",
           "check_request_id", "parse_eos"]

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
    """

    def __init__(self) -> None:
        super().__init__()
        self.finished: frozenset[int] = frozenset()
        self.errors: dict[int, RequestFailed] = {}
        self.statuses: dict[int, RequestStatus] = {}
        self.admitted: dict[int, int] = {}

    def __repr__(self) -> str:
        return (f"StepEvents({dict.__repr__(self)}, finished={sorted(self.finished)}, "
                f"errors={sorted(self.errors)}, admitted={self.admitted})")


class Request:
    """A request's prompt, budget, sampler and progress (the engine's record).

    While running, every token but the last generated one has its K/V in the
    cache: ``seq.num_tokens == len(prompt) + len(generated) - 1``.
    ``isolate`` marks a request whose batch failed: its next decode step
    runs it alone, so that a failure there is its own.
    """

    __slots__ = ("rid", "prompt", "max_new_tokens", "eos", "params", "rng", "salt",
                 "generated", "seq", "finish_reason", "error", "num_cached", "admitted",
                 "isolate")

    def __init__(self, prompt: np.ndarray, max_new_tokens: int, eos: frozenset[int],
                 params: SamplingParams, rng: np.random.Generator | None, salt: Any) -> None:
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


def parse_eos(eos: Any) -> frozenset:
    """``eos_token_id`` as a set of token ids (None: none), else a typed error."""
    if eos is None:
        return frozenset()
    if isinstance(eos, (str, bytes)):
        raise DTypeError(f"Invalid eos_token_id: expected an integer or integers, "
                         f"got {type(eos).__name__}")
    try:
        items = [eos] if is_int(eos) else list(eos)
    except TypeError:
        raise DTypeError(f"Invalid eos_token_id: expected an integer or integers, "
                         f"got {type(eos).__name__}") from None
    for t in items:
        if not is_int(t):
            raise DTypeError(f"Invalid eos_token_id: expected integers, got {t!r}")
    return frozenset(int(t) for t in items)
