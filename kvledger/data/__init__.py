"""Reference data shipped inside the package (read-only).

``configs/`` holds real Hugging Face ``config.json`` files of public models, named
``<org>__<model>.json``; ``configs/SOURCES.md`` says where each one came from. The ledger's
tests, the README's examples and ``kvledger plan`` use them by name through
:func:`config_path`, so nothing depends on files outside the installed package.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvledger.errors import ModelNotFoundError

_CONFIGS = "configs"


def configs_dir() -> Path:
    """Folder of the bundled ``config.json`` files (inside the installed package)."""
    return Path(str(resources.files(__name__) / _CONFIGS))


def config_names() -> list[str]:
    """Names of the bundled configs (file stems, e.g. ``"meta-llama__Llama-3.1-8B"``), sorted."""
    return sorted(p.stem for p in configs_dir().glob("*.json"))


def config_path(name: str) -> Path:
    """Path of the bundled config ``name`` (a file stem; a trailing ``.json`` is accepted).

    Raises:
        ModelNotFoundError: no bundled config of that name (the message lists the names).
    """
    stem = name.removesuffix(".json")
    path = configs_dir() / f"{stem}.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"no bundled config {stem!r}; bundled: {', '.join(config_names())}"
        )
    return path
