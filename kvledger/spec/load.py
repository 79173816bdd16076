"""``read_spec``: one entry point that sends a model argument to the reader of its format,
through the families of the table given (``kvledger.model.families.load_spec`` gives the
registry's)."""

from __future__ import annotations

from pathlib import Path

from kvledger.errors import ModelNotFoundError
from kvledger.paths import resolve_model_path
from kvledger.spec.family import FamilyTable
from kvledger.spec.gguf_reader import GGUF_MAGIC, spec_from_gguf
from kvledger.spec.hf_config import spec_from_hf_config
from kvledger.spec.model_spec import ModelSpec


def read_spec(model: str | Path, families: FamilyTable) -> ModelSpec:
    """Build a ModelSpec from ``"default"``, a ``.gguf`` file, a ``config.json`` file, or a
    folder holding a ``config.json`` (preferred) or a ``.gguf`` file.

    Raises:
        ModelNotFoundError: the path does not exist or holds neither file.
        ConfigError: the file is malformed or lacks a required key.
        UnsupportedModelError: a GGUF architecture no family reads.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        if (path / "config.json").is_file():
            return spec_from_hf_config(path / "config.json", families)
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise ModelNotFoundError(f"{path} holds neither a config.json nor a .gguf file")
        return spec_from_gguf(ggufs[0], families)
    with open(path, "rb") as f:
        is_gguf = f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    if is_gguf or path.suffix == ".gguf":
        return spec_from_gguf(path, families)
    return spec_from_hf_config(path, families)
