"""How long and how much the state DB keeps: expiry by age and by size, and a per-key quota.

- ``--state-max-age``: a conversation whose last stored turn is older is deleted;
- ``--state-max-gib``: while the file's used pages pass this size, the least recently
  continued conversations are deleted, oldest first;
- ``--state-quota-mib``: an API key whose stored bytes (responses' JSON and token ids, chunks'
  text) reached this gets HTTP 403 ``state_quota_exceeded`` for a stored turn.

Deleting reclaims the pages (:meth:`SessionStore.delete_conversation`). The server sweeps at
start, after each stored turn (size) and every :data:`SWEEP_INTERVAL_S` (age); the removed
conversations are counted in ``kvledger:session_conversations_removed{reason}``.
"""

from __future__ import annotations

from kvledger.sessions.errors import StateQuotaError
from kvledger.sessions.store import SessionStore

SWEEP_INTERVAL_S = 60.0


def expire(store: SessionStore, max_age_s: float | None, max_bytes: int | None,
           now: float) -> dict[str, int]:
    """Delete conversations past the age or size limit; how many per reason (``age``,
    ``size``)."""
    removed = {"age": 0, "size": 0}
    if max_age_s is None and max_bytes is None:
        return removed
    conversations = store.conversations_oldest_first()
    for tenant, session_id, last in conversations:
        if max_age_s is not None and now - last > max_age_s:
            reason = "age"
        elif max_bytes is not None and store.used_bytes() > max_bytes:
            reason = "size"
        else:
            break
        store.delete_conversation(tenant, session_id)
        removed[reason] += 1
    return removed


def check_quota(store: SessionStore, tenant: str, quota_bytes: int | None) -> None:
    """Refuse a stored turn of a tenant at its quota.

    Raises:
        StateQuotaError: the tenant's stored bytes reached ``quota_bytes`` (HTTP 403).
    """
    if quota_bytes is None:
        return
    used = store.tenant_bytes(tenant)
    if used >= quota_bytes:
        raise StateQuotaError(
            f"this API key's stored conversations hold {used:,} bytes, its quota is "
            f"{quota_bytes:,} (--state-quota-mib); delete responses "
            "(DELETE /v1/responses/{id}) or send store: false")
