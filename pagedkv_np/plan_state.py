"""What a cache knows about the plans it built: the index arrays stay data
(:class:`pagedkv_np.plan.Plan`), the bookkeeping lives here.

A :class:`PlanTable` maps each live plan to its :class:`PlanState`; entries
go when their plan is garbage collected, so a cache that builds a plan every
step holds only the plans its callers still hold.
"""

from __future__ import annotations

import weakref
from typing import Any

from .errors import DTypeError, StalePlanError
from .plan import Plan

__all__ = ["PlanState", "PlanTable"]


class PlanState:
    """The cache's record of one plan.

    Parameters
    ----------
    epoch : int
        The cache's epoch when the plan was built.
    seqs : tuple of Sequence
        The plan's sequences, in plan order.
    versions : tuple of int
        Their versions when the plan was built.
    num_layers : int
        Layers the plan must be written in.
    prepared : PreparedIndices, optional
        The backend's :meth:`~pagedkv_np.backends.base.Backend.prepare` of
        the plan, passed to every write and gather through it.
    """

    __slots__ = ("epoch", "seqs", "versions", "discarded", "prepared", "_written",
                 "_num_written")

    def __init__(self, epoch: int, seqs: tuple, versions: tuple, num_layers: int,
                 prepared: Any = None) -> None:
        self.epoch = epoch
        self.prepared = prepared
        self.seqs = seqs
        self.versions = versions
        self.discarded = False
        self._written = bytearray(num_layers)   # per layer: written yet?
        self._num_written = 0

    def mark_written(self, layer: int) -> bool:
        """Record a written layer; True exactly when the last one arrives."""
        if self._written[layer]:
            return False
        self._written[layer] = 1
        self._num_written += 1
        return self._num_written == len(self._written)

    @property
    def is_written(self) -> bool:
        """Whether every layer has been written through the plan."""
        return 0 < len(self._written) == self._num_written

    def is_current(self) -> bool:
        """Whether none of the plan's sequences reserved or released pages since."""
        return all(s.version == v for s, v in zip(self.seqs, self.versions))


class PlanTable:
    """Plan -> PlanState, holding plans by weak reference.

    Keyed by ``id(plan)`` with the plan's weak reference beside its state: a
    lookup, once per layer written or gathered, is then a dict probe and a
    call of that reference, with no weak reference made for it.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, PlanState]] = {}

    def add(self, plan: Plan, state: PlanState) -> None:
        key, entries = id(plan), self._entries

        def forget(ref: weakref.ref, key: int = key) -> None:
            # the plan is gone; its id may already name a newer plan's entry
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(plan, forget), state)

    def state(self, plan: Any) -> PlanState:
        """The state of ``plan``; a typed error for anything but a plan of this table."""
        entry = self._entries.get(id(plan))
        if entry is None or entry[0]() is not plan:
            if not isinstance(plan, Plan):
                raise DTypeError(f"Invalid plan: expected a Plan, got {type(plan).__name__}")
            raise StalePlanError("Invalid plan: it was built by another cache")
        return entry[1]

    def current(self, plan: Any, epoch: int) -> PlanState:
        """The state of ``plan`` if it may still be written and gathered,
        ``epoch`` being the cache's now."""
        entry = self._entries.get(id(plan))
        if entry is None or entry[0]() is not plan:
            return self.state(plan)   # raises
        state = entry[1]
        if state.discarded:
            raise StalePlanError("Invalid plan: it was discarded")
        if state.epoch != epoch and not state.is_current():
            # (the same epoch: nothing was reserved or released since)
            raise StalePlanError(
                "Invalid plan: one of its sequences was extended or released since it "
                "was built; build a new plan")
        return state

    def __len__(self) -> int:
        return len(self._entries)
