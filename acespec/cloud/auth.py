"""Who may talk to the cloud: tenant tokens, and a per-address limit on failed authentication.

Tenants are mutually untrusted (docs/operate/security.md). Each has its own token; a session belongs to the
tenant that opened it. An address that fails authentication `failures_per_min` times within a minute
is refused unheard until its oldest failure is a minute old, so tokens and session secrets cannot be
guessed at line rate.
"""

from __future__ import annotations

import collections
import hmac
import time


class Gatekeeper:
    def __init__(self, tenants: dict[str, bytes] | None, token: bytes | None, failures_per_min: int) -> None:
        self._tokens: list[tuple[bytes, str]] = [(tok, name) for name, tok in (tenants or {}).items()]
        if token is not None:
            self._tokens.append((token, "default"))
        self.failures_per_min = failures_per_min  # 0 = no limit
        self._failures: dict[str, collections.deque] = {}  # peer address -> times of its recent failed auths

    def tenant_of(self, auth: bytes, addr: str) -> str | None:
        """The tenant whose token `auth` is ("" when there are no tokens at all); None, counted as a
        failure of `addr`, when it is nobody's."""
        if not self._tokens:
            return ""
        tenant = None
        for token, name in self._tokens:  # compare with every token, so the time says nothing about which matched
            if hmac.compare_digest(auth, token) and tenant is None:
                tenant = name
        if tenant is None:
            self.failed(addr)
        return tenant

    def failed(self, addr: str) -> None:
        limit = self.failures_per_min
        if limit <= 0:
            return
        if len(self._failures) > 4096:  # forget addresses whose failures are over a minute old
            now = time.monotonic()
            for a in [a for a, q in self._failures.items() if now - q[-1] > 60.0]:
                del self._failures[a]
        self._failures.setdefault(addr, collections.deque(maxlen=limit)).append(time.monotonic())

    def blocked(self, addr: str) -> bool:
        """`failures_per_min` failed auths from `addr` within the last minute: refuse it unheard."""
        q = self._failures.get(addr)
        limit = self.failures_per_min
        return limit > 0 and q is not None and len(q) >= limit and time.monotonic() - q[0] < 60.0
