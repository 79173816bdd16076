"""llama.cpp's own converter, ``convert_hf_to_gguf.py``, on a tiny folder, when
``KVLEDGER_LLAMA_CPP_SRC`` names its source tree (its ``gguf-py`` put first on ``PYTHONPATH``,
beside what the environment already has there: the converter imports ``sentencepiece``); the
tests that use it skip without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def convert(folder: Path, path: Path, *options: str) -> bool:
    """The converter on ``folder`` (F32, at ``path``, with ``options``); False when
    ``KVLEDGER_LLAMA_CPP_SRC`` is not set.

    Raises:
        subprocess.CalledProcessError: the converter failed (its output in the error).
    """
    src = os.environ.get("KVLEDGER_LLAMA_CPP_SRC")
    if not src:
        return False
    paths = [str(Path(src) / "gguf-py"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    subprocess.run([sys.executable, str(Path(src) / "convert_hf_to_gguf.py"), str(folder),
                    "--outtype", "f32", "--outfile", str(path), *options], env=env, check=True,
                   capture_output=True)
    return True
