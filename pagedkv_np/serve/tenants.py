"""Tenants of ``pagedkv serve``: who a request comes from, and which cached
pages it may share.

With API keys, every key is a tenant of its own: its id is a digest of the
key (never the key itself, which would then sit in memory beside every
request), and its prompts share cached pages only with its own. A
request's ``cache_salt`` splits a tenant further. Without keys there is one
anonymous tenant.
"""

from __future__ import annotations

import hashlib
import hmac

from .api_error import APIError

__all__ = ["tenant_of", "cache_salt"]


def tenant_of(api_keys: tuple[str, ...], authorization: str) -> str | None:
    """The caller's tenant id from its ``Authorization`` header, None without keys.

    Raises
    ------
    APIError
        401: no key, or not one of ``api_keys``.
    """
    if not api_keys:
        return None
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError("Missing API key: send 'Authorization: Bearer KEY'", status=401,
                       code="invalid_api_key")
    matched = False
    for k in api_keys:   # every key compared, in constant time each
        matched |= hmac.compare_digest(k.encode(), key.encode())
    if not matched:
        raise APIError("Incorrect API key provided", status=401, code="invalid_api_key")
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The prefix cache's salt of a request: its tenant and its ``cache_salt``
    (None: shared with every request without either)."""
    parts = []
    if tenant is not None:
        parts.append(f"key:{tenant}")
    if salt is not None:
        parts.append(f"salt:{salt}")
    return "\n".join(parts) if parts else None
