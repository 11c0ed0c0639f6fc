"""CacheStats: a snapshot of a cache's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CacheStats"]


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters (see :attr:`PagedKVCache.stats`)."""

    num_pages: int
    pages_used: int
    pages_free: int
    pages_evictable: int
    num_sequences: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tiers: dict = field(default_factory=dict)   # per tier: hits, misses, bytes, drops, ...

    @classmethod
    def of(cls, pool: Any, index: Any, tiers: Any, num_sequences: int) -> CacheStats:
        """The counters of a cache's ``pool``, ``index`` and ``tiers`` (or None) now."""
        return cls(num_pages=pool.num_pages, pages_used=pool.num_used,
                   pages_free=pool.num_free, pages_evictable=pool.num_evictable,
                   num_sequences=num_sequences, prefix_hit_tokens=index.hit_tokens,
                   prefix_query_tokens=index.query_tokens,
                   tiers=tiers.stats if tiers is not None else {})

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any query)."""
        queried = self.prefix_query_tokens
        return self.prefix_hit_tokens / queried if queried else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        if not d["tiers"]:   # listed only for a cache with tiers
            del d["tiers"]
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d

    def __getitem__(self, key: str):
        return self.as_dict()[key]
