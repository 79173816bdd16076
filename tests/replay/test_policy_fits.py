"""Step model fits per retention policy: the kept-token features against the live engine's
retention state, the policy grid evicting, the fits file (saved, loaded, chosen, old format),
and ``probe --steps`` / ``replay`` with ``--kv-policy`` on the tiny model."""

from __future__ import annotations

import json
import random
import shlex

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.errors import ConfigError
from kvledger.ledger import local_fits
from kvledger.ledger.hardware import Device, save_local_device
from kvledger.ledger.retention import RetentionSpec, spec_from_options
from kvledger.ledger.step_model import Efficiency, StepFeatures, StepTimeModel, kept_context
from kvledger.replay.fit import (
    FIT_WEIGHTS_MBU,
    POLICY_OUTPUT_TOKENS,
    fit,
    measure_steps,
    policy_grid,
)

SINKS = {"kv_policy": "sinks", "kv_window": 8, "kv_sinks": 4}
SINKS_FLAGS = ("--kv-policy", "sinks", "--kv-window", "8", "--kv-sinks", "4")
POLICIES = {"window": {"kv_policy": "window", "kv_window": 12}, "sinks": SINKS,
            "h2o": {"kv_policy": "h2o", "kv_budget": 20},
            "snapkv": {"kv_policy": "snapkv", "kv_budget": 40},
            "sinks-prompt": {"kv_policy": "sinks", "kv_window": 20, "kv_scope": "prompt"},
            "h2o-prompt": {"kv_policy": "h2o", "kv_budget": 20, "kv_scope": "prompt"}}
GRID_ENGINE = {"num_blocks": 1200, "max_num_seqs": 32, "max_num_batched_tokens": 2048}
DEVICE = Device("local", 16.0, 20.0, 0.5, "test")


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A fresh config folder with a measured ``local`` device (:data:`DEVICE`)."""
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))
    save_local_device(DEVICE)
    return tmp_path / "config"


@pytest.mark.parametrize("options", POLICIES.values(), ids=POLICIES)
def test_policy_grid_evicts_and_features_count_what_the_engine_holds(tiny_engine, options):
    """Every chunk the grid schedules: kept_context equals the tokens the engine's retention
    state holds at schedule time; long prompts pass the bound (prefill evicts) and the decode
    steps that follow drop tokens (snapkv: decode past its compressed prompt) and give back
    slots (window / sinks: a block emptied; h2o per head: its rows compacted) while they are
    measured."""
    engine = tiny_engine(**GRID_ENGINE, **options)
    spec = engine.config.retention
    seen = []  # (request id, start, new tokens, prompt tokens, held, slots) at schedule time
    steps = []
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        steps.extend([plan] if plan.chunks else [])
        seen.extend((c.request.request_id, c.start, c.num_new_tokens,
                     c.request.num_prompt_tokens, c.request.retention.num_held,
                     c.request.retention.num_slots) for c in plan.chunks)
        return plan

    engine.scheduler.schedule = spy
    samples = measure_steps(engine, policy_grid(spec), POLICY_OUTPUT_TOKENS)
    assert len(samples) == len(steps)
    assert all(kept_context(spec, start, prompt) == held
               for _, start, _, prompt, held, _ in seen)
    decodes = [s for s in seen if s[2] == 1 and s[1] >= s[3]]
    assert any(held < start for _, start, _, _, held, _ in decodes), "no decode past eviction"
    if not spec.compresses_prompt:
        prefill = [s for s in seen if s[1] < s[3]]
        assert any(held < start for _, start, _, _, held, _ in prefill), "prefill never evicted"
        lag = {}  # slots - position falls during one request's decode: slots given back
        fell = False
        for rid, start, _, prompt, _, n in decodes:
            fell = fell or (rid in lag and n - start < lag[rid])
            lag[rid] = n - start
        assert fell, "no slot given back during the measured decode"


def test_fit_key_and_the_calibrating_command():
    """Sizes stay out of the key, modes go in; the suggested command parses back (as the CLI
    reads --kv-* options) to the same policy."""
    a = RetentionSpec("sinks", window=256, sinks=4)
    assert local_fits.fit_key(a) == local_fits.fit_key(RetentionSpec("sinks", window=1024))
    assert local_fits.fit_key(a) != local_fits.fit_key(
        RetentionSpec("sinks", window=256, positions="original"))
    assert local_fits.fit_key(RetentionSpec("h2o", budget=512)) != local_fits.fit_key(
        RetentionSpec("h2o", budget=512, select="per-sequence"))
    assert local_fits.fit_key(RetentionSpec()) == "full"
    assert local_fits.fit_key(RetentionSpec("h2o", budget=512, scope="prompt")) \
        == "h2o/per-head/prompt"
    for spec in (a, RetentionSpec("sinks", window=256, positions="original"),
                 RetentionSpec("h2o", budget=512, select="per-sequence"),
                 RetentionSpec("snapkv", budget=300), RetentionSpec("window", window=64),
                 RetentionSpec("sinks", window=64, scope="prompt")):
        words = shlex.split(local_fits.probe_command(spec))
        assert words[:4] == ["kvledger", "probe", "--steps", "--no-kernels"]
        flags = dict(zip(words[4::2], words[5::2]))
        sizes = {k: int(flags[f"--kv-{k}"]) if f"--kv-{k}" in flags else None
                 for k in ("window", "sinks", "budget")}
        parsed = spec_from_options(flags["--kv-policy"], sizes["window"], sizes["sinks"],
                                   sizes["budget"], flags.get("--kv-positions"),
                                   flags.get("--kv-select"), flags.get("--kv-scope"))
        assert parsed == spec


def _synthetic_fit(truth: Efficiency, spec: RetentionSpec, seed: int):
    """Fit on steps whose durations are the step model's under ``truth``: random prefill and
    decode chunks, contexts as ``spec`` keeps them."""
    from kvledger.model.catalogue import load_model_spec

    model = StepTimeModel(load_model_spec("default"), DEVICE, truth)
    rng = random.Random(seed)
    samples = []
    for _ in range(40):
        chunks = [(kept_context(spec, rng.randrange(0, 2000), 4000),
                   rng.choice([1, 1, 1, 64, 512])) for _ in range(rng.randrange(1, 30))]
        f = StepFeatures.of(chunks)
        samples.append((f, model.duration(f)))
    return fit(samples, model, f"test {spec.policy}")


def _same(got: Efficiency, truth: Efficiency) -> None:
    for name in ("mfu", "mbu", "step_overhead_s", "seq_overhead_s", "decode_group_s",
                 "paged_mfu", "weights_mbu"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name


def test_fits_saved_per_policy_and_chosen_by_the_setting(config_dir):
    full_truth = Efficiency(mfu=0.3, mbu=0.6, step_overhead_s=0.004, seq_overhead_s=0.0002,
                            source="", decode_group_s=0.003, paged_mfu=0.05,
                            weights_mbu=FIT_WEIGHTS_MBU)
    sinks_truth = Efficiency(mfu=0.1, mbu=0.25, step_overhead_s=0.006, seq_overhead_s=0.002,
                             source="", decode_group_s=0.001, paged_mfu=0.2,
                             weights_mbu=FIT_WEIGHTS_MBU)
    sinks = RetentionSpec("sinks", window=256)
    for truth, spec, seed in ((full_truth, RetentionSpec(), 0), (sinks_truth, sinks, 1)):
        eff, stats = _synthetic_fit(truth, spec, seed)
        local_fits.save_fit(spec, eff, DEVICE, stats)
    saved = json.loads(local_fits.local_step_model_path().read_text())
    assert set(saved["fits"]) == {"full", "sinks/cache"}
    assert saved["fits"]["sinks/cache"]["fit"]["retention"]["window"] == 256
    # another window: the same fit (the features count its kept tokens)
    eff, note = local_fits.local_efficiency(DEVICE, RetentionSpec("sinks", window=1024))
    _same(eff, sinks_truth)
    assert note is None and "test sinks" in eff.source
    eff, note = local_fits.local_efficiency(DEVICE, RetentionSpec())
    _same(eff, full_truth)
    assert note is None
    # no h2o fit: the full one, said so in the source and in one line naming the command
    h2o = RetentionSpec("h2o", budget=512)
    eff, note = local_fits.local_efficiency(DEVICE, h2o)
    _same(eff, full_truth)
    assert "h2o/per-head not calibrated, the full-retention fit" in eff.source
    assert note.startswith("retention cost not calibrated: no local step fit for h2o/per-head")
    assert "`kvledger probe --steps --no-kernels --kv-policy h2o --kv-window 256 --kv-sinks 4 " \
           "--kv-budget 512`" in note
    # re-probing one policy replaces that fit only
    eff, stats = _synthetic_fit(full_truth, sinks, 2)
    local_fits.save_fit(sinks, eff, DEVICE, stats)
    _same(local_fits.local_efficiency(DEVICE, sinks)[0], full_truth)
    _same(local_fits.local_efficiency(DEVICE, RetentionSpec())[0], full_truth)


def test_a_fit_keeps_its_step_times_when_a_later_probe_measures_other_peaks(config_dir):
    from kvledger.model.catalogue import load_model_spec

    truth = Efficiency(mfu=0.3, mbu=0.6, step_overhead_s=0.004, seq_overhead_s=0.0002,
                       source="t", decode_group_s=0.002, paged_mfu=0.05, weights_mbu=0.9)
    local_fits.save_fit(RetentionSpec(), truth, DEVICE, {})
    later = Device("local", 16.0, 31.0, 0.8, "re-measured")
    eff, _ = local_fits.local_efficiency(later, RetentionSpec())
    spec = load_model_spec("default")
    f = StepFeatures.of([(700, 1), (30, 64), (0, 300)])
    assert StepTimeModel(spec, later, eff).duration(f) == pytest.approx(
        StepTimeModel(spec, DEVICE, truth).duration(f), rel=1e-12)


def test_old_single_fit_file_is_the_full_fit(config_dir):
    """A file as ``probe --steps`` wrote it before per-policy fits: the factors at the top."""
    old = {"mfu": 24.7, "mbu": 0.237, "step_overhead_s": 0.0, "seq_overhead_s": 0.001869,
           "source": "fitted by kvledger probe --steps on 2026-12-01 16:51",
           "fit": {"samples": 47, "median_rel_error": 0.047}}
    path = local_fits.local_step_model_path()
    path.write_text(json.dumps(old))
    eff, note = local_fits.local_efficiency(DEVICE, RetentionSpec())
    assert (eff.mfu, eff.mbu, eff.seq_overhead_s, eff.source) == (
        24.7, 0.237, 0.001869, old["source"])
    assert note is None
    eff, note = local_fits.local_efficiency(DEVICE, RetentionSpec("window", window=64))
    assert eff.mfu == 24.7 and "window/cache" in note
    local_fits.save_fit(RetentionSpec("window", window=64), eff, DEVICE, {})
    assert set(json.loads(path.read_text())["fits"]) == {"full", "window/cache"}
    assert local_fits.load_fits(DEVICE)["full"].mbu == 0.237


@pytest.mark.parametrize("text", ["{not json", '{"fits": 3}', '{"fits": {"full": {"mfu": 1}}}'])
def test_corrupt_file_is_a_config_error(config_dir, text):
    local_fits.local_step_model_path().write_text(text)
    with pytest.raises(ConfigError, match="probe --steps"):
        local_fits.local_efficiency(DEVICE, RetentionSpec())


@pytest.fixture
def no_tokenizer(monkeypatch):
    """The tiny GGUF's vocabulary makes no transformers tokenizer; the probe's prompts are
    token ids, so its engine runs without one (as ``tiny_engine``'s do)."""
    monkeypatch.setattr("kvledger.model.weights.loader.load_tokenizer", lambda path: None)


def _cli(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.output


PROBE = ("probe", "--steps", "--no-kernels", "--buffer-mib", "4", "--matmul-n", "64",
         "--repeats", "1", "--threads", "1")


def test_probe_steps_with_a_policy_then_replay_uses_its_fit(tiny_engine, live_trace, config_dir,
                                                            no_tokenizer, tmp_path):
    model = tiny_engine.path
    code, out = _cli(*PROBE, "--model", model, *SINKS_FLAGS)
    assert code == 0, out
    assert "as the sinks/cache fit" in out and "sinks (4 sinks + 8 recent)" in out
    fits = json.loads(local_fits.local_step_model_path().read_text())["fits"]
    assert set(fits) == {"sinks/cache"}
    assert fits["sinks/cache"]["fit"]["retention"]["window"] == 8
    assert fits["sinks/cache"]["fit"]["samples"] >= 4

    trace, _ = live_trace(**SINKS)  # recorded under sinks 4 + 8 (cache positions)
    base = ("replay", trace, "--device", "local", "--model", model)
    code, out = _cli(*base, "--engine-from-trace", "--out", tmp_path / "a")
    assert code == 0, out
    assert "retention sinks/cache" in out and "not calibrated" not in out
    meta = json.loads((tmp_path / "a" / "results.json").read_text())["meta"]
    assert "retention sinks/cache" in meta["step_model"]
    # a policy with no fit (and no full fit either): the defaults, and the line saying so
    code, out = _cli(*base, "--kv-policy", "h2o", "--kv-budget", "20", "--out", tmp_path / "b")
    assert code == 0, out
    line = [x for x in out.splitlines() if x.startswith("retention cost not calibrated")]
    assert len(line) == 1 and "h2o/per-head" in line[0] and "assumed defaults" in line[0]
    assert "kvledger probe --steps --no-kernels --kv-policy h2o --kv-window 10 --kv-sinks 4 " \
           "--kv-budget 20" in out.replace("\n", " ")
    # a sweep over policies: one step model per setting
    code, out = _cli(*base, "--kv-policy", "sinks", "--kv-window", "8", "--sweep",
                     "kv-policy=sinks,window",
                     "--out", tmp_path / "c")
    assert code == 0, out
    assert "step model for kv-policy=sinks: fitted" in out
    assert "step model for kv-policy=window: assumed defaults" in out


def test_probe_steps_from_a_policy_trace_fits_that_policy(tiny_engine, live_trace, config_dir,
                                                         no_tokenizer):
    trace, _ = live_trace(**SINKS)
    code, out = _cli(*PROBE, "--model", tiny_engine.path, "--steps-from", trace)
    assert code == 0, out
    assert set(json.loads(local_fits.local_step_model_path().read_text())["fits"]) == \
        {"sinks/cache"}
    code, out = _cli(*PROBE, "--model", tiny_engine.path, "--steps-from", trace,
                     "--kv-policy", "window", "--kv-window", "8")
    assert code == 2 and "drop the --kv-* options" in out
    code, out = _cli("probe", "--no-kernels", "--kv-policy", "window", "--kv-window", "8")
    assert code == 2 and "--kv-policy applies to --steps" in out
    code, out = _cli("probe", "--no-kernels", "--steps-from", trace)
    assert code == 2 and "--steps-from applies to --steps" in out


def test_the_traces_own_measurements_are_compared_only_on_a_rerun(live_trace, config_dir,
                                                                 tmp_path):
    """The finish lines measure the recorded setting: a replay of that setting (device local,
    the engine options from the trace) prints the error against them, a what-if does not."""
    trace, engine = live_trace()
    base = ["replay", str(trace), "--device", "local", "--model", str(engine.config.model),
            "--out", str(tmp_path / "out")]
    for extra, compared in (([], False), (["--engine-from-trace"], True),
                            (["--engine-from-trace", "--speed", "2"], False),
                            (["--engine-from-trace", "--sweep", "max-num-seqs=2,4"], False)):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        assert ("predicted vs measured" in r.output) == compared, extra
        assert ("not compared with the trace's own measurements" in r.output) != compared
