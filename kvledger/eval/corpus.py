"""The text an evaluation reads: a file, or by default Python's own ``pydoc_data.topics``
(the help topics shipped with every CPython: real English prose and code, no download)."""

from __future__ import annotations

from pathlib import Path

from kvledger.errors import InvalidParameterError

DEFAULT_TEXT_NAME = "pydoc_data.topics"


def default_text() -> str:
    """All pydoc topics, in sorted topic order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def read_text(path: Path | None) -> tuple[str, str]:
    """(text, its name) of ``path``, or of :func:`default_text` when ``path`` is None.

    Raises:
        InvalidParameterError: the file cannot be read as UTF-8 text, or is empty.
    """
    if path is None:
        return default_text(), DEFAULT_TEXT_NAME
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"--text {path}: cannot read it ({exc})") from None
    if not text.strip():
        raise InvalidParameterError(f"--text {path}: the file is empty")
    return text, str(path)
