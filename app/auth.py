"""API keys: whether a request carries one, and which prefix-cache tenant it stands for.

`API_KEY` holds one key or several, comma-separated (one per tenant). The keys are kept only as HMAC digests
under a secret drawn at start, and a presented key is compared digest to digest in constant time, so neither
a timing nor this object in a memory dump gives a key away. The digest is also the key's tenant id: with
`PREFIX_CACHE_PER_KEY`, requests under one key reuse only prefix-cache entries made under the same key
(app/core/engine/prefix_cache.py), so one tenant cannot probe another's prompts through `cached_tokens`. The id means
nothing outside this process and changes at each start, as the cache itself does.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Callable


def split_keys(setting: str | None) -> tuple[str, ...]:
    """`API_KEY="key-a,key-b"` -> the keys, blanks dropped (a key cannot hold a comma)."""
    return tuple(key.strip() for key in (setting or "").split(",") if key.strip())


class ApiKeys:
    def __init__(self, setting: str | None):
        self._secret = secrets.token_bytes(32)
        self._digests = tuple(self._digest(key) for key in split_keys(setting))

    def __len__(self) -> int:
        return len(self._digests)

    def _digest(self, key: str) -> str:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()

    def digest(self, key: str) -> str:
        """The tenant id of one configured key (app/batch/service.py maps it to a batch owner)."""
        return self._digest(key)

    def tenant_of_headers(self, headers) -> str | None:
        """The tenant id of the key a request's headers present: `Authorization: Bearer <key>`, or Anthropic's
        `x-api-key`. `headers`: any case-insensitive mapping (starlette's `Headers`). The routes ask it
        (app/api.py `require_api_key`), and so does app/main.py before it lets an upload's body in."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        return self.tenant(bearer, headers.get("x-api-key", "").strip())

    def tenant(self, *presented: str) -> str | None:
        """The tenant id of the first presented key that is one of ours, else None. Every pair is compared, with
        no early exit, so the time taken does not say which key matched or how much of one."""
        found = None
        for candidate in presented:
            if not candidate:
                continue
            digest = self._digest(candidate)
            for ours in self._digests:
                if hmac.compare_digest(digest, ours) and found is None:
                    found = ours
        return found


def priority_grant(setting: str | None, api_keys: ApiKeys) -> Callable[[str | None], bool]:
    """PRIORITY_KEYS as a test on a request's tenant: may it send a `priority` below 0? `*`: anyone; else the
    tenants of the keys it names (each must also be in API_KEY to be presented at all)."""
    keys = split_keys(setting)
    if "*" in keys:
        return lambda tenant: True
    granted = frozenset(api_keys.digest(key) for key in keys)
    return lambda tenant: tenant in granted
