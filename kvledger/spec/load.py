"""``load_spec``: one entry point that sends a model argument to the reader of its format."""

from __future__ import annotations

from pathlib import Path

from kvledger.errors import ModelNotFoundError
from kvledger.paths import resolve_model_path
from kvledger.spec.gguf_reader import GGUF_MAGIC, spec_from_gguf
from kvledger.spec.hf_config import spec_from_hf_config
from kvledger.spec.model_spec import ModelSpec


def load_spec(model: str | Path) -> ModelSpec:
    """Build a ModelSpec from ``"default"``, a ``.gguf`` file, a ``config.json`` file, or a
    folder holding a ``config.json`` (preferred) or a ``.gguf`` file.

    Raises:
        ModelNotFoundError: the path does not exist or holds neither file.
        ConfigError: the file is malformed or lacks a required key.
        UnsupportedModelError: a GGUF architecture the reader does not know.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        if (path / "config.json").is_file():
            return spec_from_hf_config(path / "config.json")
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise ModelNotFoundError(f"{path} holds neither a config.json nor a .gguf file")
        return spec_from_gguf(ggufs[0])
    with open(path, "rb") as f:
        is_gguf = f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    if is_gguf or path.suffix == ".gguf":
        return spec_from_gguf(path)
    return spec_from_hf_config(path)
