"""``kvledger calibrate``: magnitudes from the cached K/V, the outlier choice, the error table,
a file the engine loads."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger.eval.calibrate import calibrate
from kvledger.ledger.kv_format import KVFormatSpec


@pytest.fixture(scope="module")
def calibration(tiny_llama):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="fp32", num_blocks=8, kv_cache_dtype="fp32",
                                    attention="paged-torch"), spec=spec, weights=weights)
    rng = random.Random(2)
    chunks = [[rng.randrange(3, 320) for _ in range(64)] for _ in range(2)]
    return engine, calibrate(engine, chunks, KVFormatSpec("int4", outlier_channels=2)), chunks


def test_magnitudes_are_the_cached_keys_largest_values(calibration):
    engine, cal, _ = calibration
    spec = engine.spec
    assert cal.key_absmax.shape == (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    assert cal.tokens == 128
    assert (cal.key_absmax > 0).all() and (cal.value_absmax > 0).all()
    assert cal.outliers.shape == (spec.num_layers, spec.num_kv_heads, 2)
    top = cal.key_absmax.argmax(-1)
    assert (cal.outliers == top[..., None]).any(-1).all()  # the largest channel is kept
    assert engine.stats()["kv_blocks_free"] == 8


def test_outliers_lower_the_key_error_and_the_file_loads(calibration, tiny_llama, tmp_path):
    engine, cal, _ = calibration
    assert (cal.key_error_outliers <= cal.key_error + 1e-6).all()
    assert (cal.key_error > 0).all() and (cal.value_error > 0).all()
    path = tmp_path / "cal.json"
    folder, _ = tiny_llama
    cal.model = folder.name
    cal.write(path, "random tokens")
    import dataclasses

    from kvledger.engine.engine import LLMEngine

    cfg = dataclasses.replace(engine.config, kv_cache_dtype="int4", kv_outlier_channels=2,
                              kv_calibration=str(path))
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights(folder, torch.float32)
    q = LLMEngine(cfg, spec=spec, weights=weights)
    assert torch.equal(q.store.key_codecs[1].channels, cal.outliers[1])


def test_heatmap_is_a_png(calibration, tmp_path):
    from kvledger.eval.calibrate import write_heatmap

    _, cal, _ = calibration
    write_heatmap(cal, tmp_path / "heat.png")
    assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
