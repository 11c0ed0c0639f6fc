"""Storage tiers below the page pool: a disk tier that outlives the process,
a Redis tier shared by processes and machines.

See :mod:`pagedkv_np.tiers.base` for the interface, the entry format and the
keys, and :mod:`pagedkv_np.tiers.manager` for how the cache uses them.
"""

from .base import (FORMAT_VERSION, CorruptPage, PageFormat, PageRecord, Tier, TierStats,
                   TierUnavailable, decode_page, encode_page, page_key, tier_scope)
from .disk import DiskTier
from .fingerprint import model_fingerprint
from .config import open_tiers
from .manager import TierManager

__all__ = ["FORMAT_VERSION", "CorruptPage", "PageFormat", "PageRecord", "Tier", "TierStats",
           "TierUnavailable", "decode_page", "encode_page", "page_key", "tier_scope",
           "DiskTier", "RedisTier", "model_fingerprint", "TierManager", "open_tiers"]


def __getattr__(name: str):
    if name == "RedisTier":   # imported on use: the redis client is an optional extra
        from .redis import RedisTier
        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
