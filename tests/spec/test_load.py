"""``load_spec``: which reader a model argument goes to."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvledger.data import config_path
from kvledger.errors import ModelNotFoundError
from kvledger.model.families import load_spec

LLAMA = config_path("meta-llama__Llama-3.1-8B")


def test_config_file_and_folder(tmp_path):
    assert load_spec(LLAMA).num_kv_heads == 8
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    shutil.copy(LLAMA, folder / "config.json")
    spec = load_spec(folder)
    assert spec.name == "Llama-3.1-8B" and spec.num_layers == 32


def test_gguf_file_and_folder(tmp_path, gguf_kit):
    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights())
    path = gguf_kit.write(tmp_path / "tiny.gguf", tensors)
    spec = load_spec(path)
    assert spec.gguf.tensor_elements == sum(int(np.prod(t.shape)) for t in tensors.values())
    assert load_spec(tmp_path).gguf.tensor_elements == spec.gguf.tensor_elements


def test_missing_paths(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_spec(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="neither"):
        load_spec(tmp_path)


@pytest.mark.slow
def test_default_is_the_bundled_gguf():
    spec = load_spec("default")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (30, 3, 64)
    assert spec.gguf.tensor_elements == 134_515_008
