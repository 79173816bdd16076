"""Errors of the session layer, mapped to HTTP statuses like every :class:`KVLedgerError`."""

from __future__ import annotations

from kvledger.errors import KVLedgerError


class ResponseNotFoundError(KVLedgerError):
    """No stored response with this id for this API key (unknown, deleted, another tenant's)."""

    http_status = 404
    code = "response_not_found"


class SessionBusyError(KVLedgerError):
    """Another turn of the same conversation is still running past the wait limit (HTTP 409)."""

    http_status = 409
    code = "session_busy"


class DocumentTooLargeError(KVLedgerError):
    """An attached document is larger than the server accepts (HTTP 413)."""

    http_status = 413
    code = "document_too_large"


class TurnTooLargeError(KVLedgerError):
    """The conversation (or the new turn alone) does not fit the token budget (HTTP 400)."""

    code = "context_length_exceeded"


class StateStoreError(KVLedgerError):
    """The state database cannot be opened: corrupt, locked, not SQLite (CLI exit 2)."""


class StateStoreUnavailableError(StateStoreError):
    """The state database failed while serving: locked by another process past the busy
    timeout, or an I/O error (HTTP 503 with Retry-After: a lock passes; the turn is not
    stored, the conversation is released, other requests are unaffected)."""

    http_status = 503
    code = "state_db_unavailable"


class StateQuotaError(KVLedgerError):
    """The API key's stored conversations reached ``--state-quota-mib`` (HTTP 403: retrying
    cannot help; delete responses or send ``store: false``)."""

    http_status = 403
    code = "state_quota_exceeded"
