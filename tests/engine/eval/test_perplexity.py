"""``kvledger eval perplexity``: llama.cpp's protocol, through the engine's cache path.

Oracles: transformers' own forward on the same weights and tokens (bundled model, fp32), a
hand count of the protocol's scored tokens, and self-consistency of the cache path (feeding
the chunk in one prefill, in chunks, or one token at a time must give the same numbers).
"""

from __future__ import annotations

import math
import random

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.eval.perplexity import chunk_tokens, perplexity


def _ids(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def test_protocol_cuts_non_overlapping_chunks_and_scores_the_second_halves(tiny_engine_factory):
    ids = _ids(1000)
    chunks = chunk_tokens(ids, 256)
    assert [len(c) for c in chunks] == [256, 256, 256]  # 1000 // 256, remainder dropped
    assert chunks[1] == ids[256:512]
    result = perplexity(tiny_engine_factory(num_blocks=16), ids, 256, max_chunks=2)
    assert (result.chunks, result.tokens_scored) == (2, 2 * 127)  # positions 128..254 each
    assert result.ppl == pytest.approx(math.exp(result.nll))
    assert min(result.chunk_ppl) <= result.ppl <= max(result.chunk_ppl)


@pytest.mark.parametrize("stride", [40, 1])
def test_stride_changes_the_path_not_the_numbers(tiny_engine_factory, stride):
    engine = tiny_engine_factory(num_blocks=16)
    whole = perplexity(engine, _ids(400), 96)
    stepped = perplexity(engine, _ids(400), 96, stride=stride)
    assert stepped.ppl == pytest.approx(whole.ppl, rel=1e-5)
    assert engine.stats()["kv_blocks_free"] == 16  # every chunk's blocks went back


def test_the_default_stride_is_the_engines_prefill_chunk(tiny_engine_factory):
    """As ``generate`` and ``serve`` prefill a prompt: ``max_num_batched_tokens`` tokens per
    step, the whole chunk when it is shorter (issue 58). int4 KV, so the step matters: a
    prefill step reads its own tokens as computed, earlier steps' from the pool."""
    engine = tiny_engine_factory(num_blocks=16, max_num_batched_tokens=32, kv_cache_dtype="int4")
    default = perplexity(engine, _ids(400), 96)
    assert default.stride == 32
    assert default.ppl == perplexity(engine, _ids(400), 96, stride=32).ppl
    assert default.ppl != perplexity(engine, _ids(400), 96, stride=96).ppl
    assert perplexity(engine, _ids(400), 24).stride == 24


def test_kl_divergence_against_itself_is_zero(tiny_engine_factory):
    engine, base = tiny_engine_factory(num_blocks=16), tiny_engine_factory(num_blocks=16)
    r = perplexity(engine, _ids(300), 128, base=base)
    assert r.kld_mean == pytest.approx(0.0, abs=1e-6)
    assert r.top1_agreement == 1.0
    assert r.ppl_base == pytest.approx(r.ppl)


def test_kld_percentile_is_numpys_linear_percentile():
    """llama.cpp's percentile (interpolation at fraction x (n - 1)) is numpy's default."""
    import numpy as np
    import torch

    from kvledger.eval.perplexity import kld_percentile

    values = torch.rand(1001, generator=torch.Generator().manual_seed(0)).double().sort().values
    for fraction in (0.5, 0.99, 0.999, 1.0):
        assert kld_percentile(values, fraction) == pytest.approx(
            float(np.percentile(values.numpy(), 100 * fraction)), rel=1e-12)


SMALL_WINDOW = {"kv_residual_tokens": 32, "kv_intact_tokens": 0}
"""A window smaller than the 128-token chunks of these tests, no intact tokens: a lossy run."""


def test_kld_percentiles_of_a_lossy_kv_run(tiny_engine_factory):
    """int4 KV against an fp32 base: the summary statistics of the per-position KLD, in
    order, the mean at most the maximum. 32 tokens per step: a prefill step reads its own
    tokens as computed (issue 58), so a chunk in one step would give no KLD at all; a window
    of 32 tokens, not the default 128, which would hold most of a 128-token chunk."""
    engine = tiny_engine_factory(num_blocks=16, kv_cache_dtype="int4", **SMALL_WINDOW)
    base = tiny_engine_factory(num_blocks=16)
    r = perplexity(engine, _ids(300), 128, 32, base=base)
    assert 0 < r.kld_median <= r.kld_p99 <= r.kld_p999 <= r.kld_max
    assert r.kld_mean <= r.kld_max


def test_engines_sharing_one_base_run_get_their_own_figures(tiny_engine_factory, monkeypatch):
    """perplexity_runs feeds the base once per chunk for several engines: each engine's
    figures equal the ones of a run alone (PPL without a base; the KLD against its own base
    run), the base's PPL equals its own run, and one figure set comes after each chunk."""
    from kvledger.eval import perplexity as module

    ids, chunks = _ids(300), 2
    # (int2, not int8: with a step's own tokens read as computed, issue 58, int8's KLD here is
    # at float noise, ~1e-8 either sign)
    engines = [tiny_engine_factory(num_blocks=16, kv_cache_dtype=f, **SMALL_WINDOW)
               for f in ("int4", "int2")]
    base = tiny_engine_factory(num_blocks=16)
    fed = []
    real = module.step_logprobs
    monkeypatch.setattr(module, "step_logprobs",
                        lambda e, *a, **k: (fed.append(e), real(e, *a, **k))[1])
    runs = list(module.perplexity_runs(engines, ids, 128, 32, chunks, base))
    assert [r[0].chunks for r in runs] == [1, 2]
    assert fed.count(base) == chunks  # the base ran once per chunk, not once per engine
    monkeypatch.setattr(module, "step_logprobs", real)
    alone_base = perplexity(base, ids, 128, 32, chunks)
    for engine, shared in zip(engines, runs[-1]):
        alone = perplexity(engine, ids, 128, 32, chunks)
        paired = perplexity(engine, ids, 128, 32, chunks,
                            base=tiny_engine_factory(num_blocks=16))
        assert shared.ppl == pytest.approx(alone.ppl, rel=1e-6)
        assert shared.ppl_base == pytest.approx(alone_base.ppl, rel=1e-6)
        assert shared.kld_mean == pytest.approx(paired.kld_mean, rel=1e-5)
        assert shared.kld_max == pytest.approx(paired.kld_max, rel=1e-5)
        assert shared.kld_mean > 0


@pytest.mark.slow
def test_full_precision_kv_perplexity_equals_transformers(hf_oracle):
    """The engine's PPL (fp32, fp32 KV) on real text equals the one computed from
    transformers' logits on the same GGUF weights and tokens, within 0.1 %."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.eval.corpus import default_text
    from kvledger.eval.scoring import load_engines

    context, n_chunks = 256, 3
    engine, _ = load_engines(EngineConfig(dtype="fp32", kv_cache_dtype="fp32"), context)
    ids = engine.tokenizer.encode(default_text()[:40000], add_special_tokens=False)
    ours = perplexity(engine, ids, context, max_chunks=n_chunks)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in range(n_chunks):
            chunk = torch.tensor(ids[i * context:(i + 1) * context])
            logp = torch.log_softmax(hf_oracle(chunk[None]).logits[0].float(), dim=-1)
            first = context // 2
            nll -= float(logp[first:-1].gather(1, chunk[first + 1:, None]).sum())
            count += context - 1 - first
    assert ours.tokens_scored == count
    assert ours.ppl == pytest.approx(math.exp(nll / count), rel=1e-3)


@pytest.mark.parametrize("args, message", [
    (["--context", "2"], "--context must be >= 4"),
    (["--context", "64", "--stride", "0"], "--stride must be an integer in"),
    (["--text", "/nonexistent/file.txt"], "cannot read"),
    (["--kv-cache-dtype", "int5"], "kv_cache_dtype must be one of"),
])
def test_bad_perplexity_input_is_one_line_and_exit_2(args, message):
    out = CliRunner().invoke(app, ["eval", "perplexity", *args])
    assert out.exit_code == 2
    assert message in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("args, message", [
    (["--depth", "1.5"], "--depth must be in [0, 1]"),
    (["--depth", "half"], "comma-separated"),
    (["--trials", "0"], "--trials must be an integer in"),
])
def test_bad_passkey_input_is_one_line_and_exit_2(args, message):
    out = CliRunner().invoke(app, ["eval", "passkey", *args])
    assert out.exit_code == 2
    assert message in out.output and "Traceback" not in out.output
