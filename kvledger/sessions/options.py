"""Command-line settings of sessions: the state DB's default place and the memory policy."""

from __future__ import annotations

from pathlib import Path

from kvledger.errors import InvalidParameterError
from kvledger.paths import data_dir
from kvledger.sessions.memory import POLICIES
from kvledger.sessions.service import SessionOptions

STATE_DB_NAME = "sessions.sqlite3"


def default_state_db() -> Path:
    """``sessions.sqlite3`` in the user data folder (:func:`kvledger.paths.data_dir`)."""
    return data_dir() / STATE_DB_NAME


def session_options(state_db: str | None, memory: str, segment_turns: int) -> SessionOptions:
    """Validated :class:`SessionOptions` of ``kvledger serve`` / ``kvledger chat``.

    Raises:
        InvalidParameterError: unknown policy or ``segment_turns`` < 1.
    """
    if memory not in POLICIES:
        raise InvalidParameterError(f"--memory must be one of {', '.join(POLICIES)}, got "
                                    f"{memory!r}")
    if segment_turns < 1:
        raise InvalidParameterError(f"--segment-turns must be >= 1, got {segment_turns}")
    return SessionOptions(state_db=str(state_db or default_state_db()), memory=memory,
                          segment_turns=segment_turns)
