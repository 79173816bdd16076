"""The API keys of ``kvledger serve``: ``--api-key``, ``--api-keys-file`` and ``--admin-api-key``.

Key-file format: one key per line, the whole line with surrounding whitespace trimmed (a ``#``
inside a key is part of it); blank lines and lines whose first non-space character is ``#``
are comments. So no key may start with ``#`` (nor be empty): such a key is refused wherever it
is given, and a file that yields no key is refused, so that authentication can never be
switched off by a file that was meant to hold keys. A UTF-8 byte-order mark at the start of
the file (as some editors write) is dropped. No key may hold an invisible character (Unicode
categories Cc and Cf: NUL, other controls, a byte-order mark, a zero-width space): no client
can send it, so it is refused with the line it is on.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import InvalidParameterError

BOM = "\ufeff"
INVISIBLE = ("Cc", "Cf")  # Unicode categories: control and format characters


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server accepts: tenants' keys and admin keys (both empty: no check)."""

    keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()

    def describe(self) -> str:
        """A log line's summary (counts, never the keys)."""
        if not self.keys and not self.admin_keys:
            return "no API key: every route is open"
        return f"{len(self.keys)} API keys and {len(self.admin_keys)} admin keys"


def parse_key_file(text: str, source: str) -> list[str]:
    """The keys of a key file's text (format: the module docstring).

    Raises:
        InvalidParameterError: the text holds no key, or a key holds an invisible character.
    """
    keys = []
    for number, line in enumerate(text.removeprefix(BOM).splitlines(), 1):
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(_visible(key, f"{source} line {number}"))
    if not keys:
        raise InvalidParameterError(
            f"{source} holds no API key (only blank or '#' comment lines); the server would "
            "run without authentication. Put one key per line, or leave the option out")
    return keys


def _visible(key: str, where: str) -> str:
    """``key``, when it holds no invisible character (module docstring)."""
    bad = next((c for c in key if unicodedata.category(c) in INVISIBLE), None)
    if bad is not None:
        raise InvalidParameterError(
            f"{where}: an API key holds the invisible character U+{ord(bad):04X} "
            f"({unicodedata.name(bad, 'a control character')}), which no client can send")
    return key


def _check(key: str, option: str) -> str:
    if not key.strip():
        raise InvalidParameterError(f"{option}: an API key is empty")
    if key != key.strip():
        raise InvalidParameterError(f"{option}: an API key starts or ends with whitespace")
    if key.startswith("#"):
        raise InvalidParameterError(
            f"{option}: an API key must not start with '#' (a key file reads such a line as a "
            "comment)")
    return _visible(key, option)


def read_api_keys(keys: list[str], keys_file: str | None,
                  admin_keys: list[str] | None = None) -> ApiKeys:
    """The keys given with ``--api-key``, ``--api-keys-file`` and ``--admin-api-key``.

    Raises:
        InvalidParameterError: the file cannot be read or holds no key; a key is empty, has
            surrounding whitespace, starts with ``#`` or holds an invisible character; an
            admin key is also a tenant's key.
    """
    out = [_check(key, "--api-key") for key in keys]
    if keys_file:
        try:
            text = Path(keys_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidParameterError(f"cannot read --api-keys-file {keys_file}: {exc}") from None
        out += parse_key_file(text, f"--api-keys-file {keys_file}")
    admins = [_check(key, "--admin-api-key") for key in admin_keys or []]
    if set(admins) & set(out):
        raise InvalidParameterError("an --admin-api-key is also given as a tenant's API key")
    return ApiKeys(tuple(out), tuple(admins))
