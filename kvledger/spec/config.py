"""A ``config.json`` as its family reads it: the parsed dict with the family's spellings and
defaults applied, and errors that name the key and the file.

:func:`read_config` parses the file; :class:`Config` merges a multimodal wrapper's
``text_config`` over its top level, drops null values, and takes every key a config may omit
from the defaults its family gives (the transformers config class's, ``kvledger.spec.Family``).
Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kvledger.errors import ConfigError


def read_config(path: Path) -> dict:
    """Parse a config.json file into a dict.

    Raises:
        ConfigError: unreadable, not JSON (or truncated), or not a JSON object.
    """
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON (truncated or corrupt?): {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object of config keys")
    return raw


def merged(raw: dict) -> dict:
    """The config with a multimodal wrapper's ``text_config`` merged over its top level."""
    nested = raw.get("text_config")
    return {**raw, **nested} if isinstance(nested, dict) else dict(raw)


class Config:
    """A config dict with its family's defaults applied (``defaults`` under the config's
    values; null values count as absent) and errors that name the file."""

    def __init__(self, cfg: dict, path: Path, defaults: Mapping = {}):
        self.path = path
        self.model_type = str(cfg.get("model_type") or "")
        self.cfg = {**defaults, **{k: v for k, v in cfg.items() if v is not None}}

    def req(self, key: str):
        """Value of a required key; ConfigError naming the key and file when absent."""
        if key not in self.cfg:
            raise ConfigError(f"{self.path} lacks the required key {key!r}")
        return self.cfg[key]

    def get(self, key: str, default=None):
        return self.cfg.get(key, default)

    def object(self, key: str) -> dict:
        """Value of an optional JSON object key ({} when absent or null)."""
        value = self.get(key) or {}
        if not isinstance(value, dict):
            raise ConfigError(f"{self.path}: {key!r} must be an object, got {value!r}")
        return value

    def int(self, key: str) -> int:
        value = self.req(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{self.path}: {key!r} must be an integer, got {value!r}")
        return value

    def number(self, key: str) -> float:
        """``float`` of a required numeric key; ConfigError naming the key and file when it is
        absent or no number (its range is the spec's, ``spec/ranges.py``)."""
        value = self.req(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.path}: {key!r} must be a number, got {value!r}")
        return float(value)

    def float_or_none(self, key: str) -> float | None:
        """``float`` of the key's value, None when absent."""
        value = self.get(key)
        return None if value is None else float(value)
