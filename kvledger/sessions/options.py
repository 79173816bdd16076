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


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, option: str) -> float:
    """Seconds of ``"90"``, ``"90s"``, ``"15m"``, ``"12h"`` or ``"30d"``.

    Raises:
        InvalidParameterError: not a positive number with an optional unit.
    """
    unit = DURATION_UNITS.get(text[-1:].lower()) if text else None
    number = text[:-1] if unit else text
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidParameterError(f"{option} must be a positive duration such as 3600, 90m, "
                                    f"12h or 30d, got {text!r}")
    return seconds


def _size(value: float | None, unit: int, option: str) -> int | None:
    if value is None:
        return None
    if not value > 0 or value == float("inf"):
        raise InvalidParameterError(f"{option} must be > 0, got {value}")
    return int(value * unit)


def session_options(state_db: str | None, memory: str, segment_turns: int,
                    max_age: str | None = None, max_gib: float | None = None,
                    quota_mib: float | None = None) -> SessionOptions:
    """Validated :class:`SessionOptions` of ``kvledger serve`` / ``kvledger chat``.

    Raises:
        InvalidParameterError: unknown policy, ``segment_turns`` < 1, a bad duration or size.
    """
    if memory not in POLICIES:
        raise InvalidParameterError(f"--memory must be one of {', '.join(POLICIES)}, got "
                                    f"{memory!r}")
    if segment_turns < 1:
        raise InvalidParameterError(f"--segment-turns must be >= 1, got {segment_turns}")
    return SessionOptions(
        state_db=str(state_db or default_state_db()), memory=memory,
        segment_turns=segment_turns,
        max_age_s=None if max_age is None else parse_duration(max_age, "--state-max-age"),
        max_bytes=_size(max_gib, 1 << 30, "--state-max-gib"),
        quota_bytes=_size(quota_mib, 1 << 20, "--state-quota-mib"))
