"""A numeric field's allowed range, and its check: one value type for every table of ranges.

The model spec's fields (``spec/ranges.py``), the engine's options (``engine/config.py``) and
the other commands' numeric options (``commands/option_ranges.py``) each declare one table of
name -> :class:`Range`; the check refuses, naming the field, a value of the wrong type (a bool
is not a number), NaN or an infinity, and a value outside the range, with the error class the
caller gives (a :class:`~kvledger.errors.KVLedgerError`: exit 2 on the command line, HTTP 400
in the server). ``docs/validation.md`` lists every table, checked against them by
``tests/test_validation_doc.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.errors import InvalidParameterError, KVLedgerError


def _bound(value: float) -> str:
    size = abs(value)
    if isinstance(value, int) and size >= 1 << 20 and size & (size - 1) == 0:
        return f"{'-' if value < 0 else ''}2^{size.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _finite(value: float) -> bool:
    """Whether ``value`` is a finite float (an integer past the float range is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes: an integer or a finite number between ``lo`` and
    ``hi`` (None: unbounded on that side; ``*_open``: the bound itself excluded), and None
    when ``optional``."""

    lo: float | None = None
    hi: float | None = None
    integer: bool = True
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False

    def text(self) -> str:
        """The range in interval notation: ``[1, 65536]``, ``(0, inf)``, ``[0, 1] or none``."""
        lo = "-inf" if self.lo is None else _bound(self.lo)
        hi = "inf" if self.hi is None else _bound(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        kind = "integer" if self.integer else "number"
        return f"{kind} in {left}{lo}, {hi}{right}" + (" or none" if self.optional else "")

    def contains(self, value) -> bool:
        """Whether ``value`` is allowed (its type included)."""
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not self.integer and not _finite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def check(self, name: str, value, error: type[KVLedgerError] = InvalidParameterError,
              where: str = ""):
        """``value`` when :meth:`contains` it, else ``error`` naming ``name`` and the range
        (``where``: appended to the message, e.g. `` in config.json``)."""
        if not self.contains(value):
            shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
            article = "an" if self.integer else "a"
            raise error(f"{name} must be {article} {self.text()}, got {shown}{where}")
        return value


def check_all(table: dict[str, Range], values: dict, error: type[KVLedgerError] =
              InvalidParameterError, where: str = "") -> None:
    """Check every field of ``table`` present in ``values``."""
    for name, allowed in table.items():
        if name in values:
            allowed.check(name, values[name], error, where)
