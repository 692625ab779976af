"""Agent tokens this server process has verified, so ingest can skip re-verifying them
in a read session of their own.

Revocation stays immediate. A hit here is never what authorises a write: ingest looks
the token up again inside the transaction that stores the snapshots
(:func:`~gpuwatch.server.auth.service.identity_of_digest`, one indexed read on the
connection the request holds anyway) and answers 403, writing nothing, when it is gone
or revoked. ``gpuwatch token revoke`` on any machine therefore refuses the very next
request on every replica; there is no TTL to wait out. What the cache saves is the
separate read session (a pool checkout, a transaction, a query) before the write one.

Only successful verifications are kept (a token created after a refusal works at
once), keyed by the token's SHA-256, never the token itself. The one property a hit
gives up, briefly: the token check normally runs in a read session so that a flood of
bad tokens never takes SQLite's write lock. A cached token that has since been revoked
takes it once, for that in-transaction lookup, and is then forgotten; its next request
is refused from the read session again.
"""

from __future__ import annotations

from gpuwatch.server.auth.service import AgentIdentity
from gpuwatch.server.lru import BoundedLru

# ~300 bytes an entry: 16,384 entries are ~5 MiB, and cover a fleet of 16,384 hosts
# (one token each). Past that, the least recently used are forgotten and cost a read
# session when they next push, as every request did without this cache.
MAX_ENTRIES = 16_384


class VerifiedTokens(BoundedLru[str, AgentIdentity]):
    """Token digest -> the identity it verified as; least recently used forgotten first."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        super().__init__(max_entries)

    def add(self, digest: str, identity: AgentIdentity) -> None:
        """Remember a token the database just confirmed."""
        self.put(digest, identity)

    def discard(self, digest: str) -> None:
        """Forget a token the database no longer confirms (revoked, or its host gone)."""
        self.pop(digest)
