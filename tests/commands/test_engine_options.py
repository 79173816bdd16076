"""Every EngineConfig field is an option of both ``generate`` and ``serve``, and its value
reaches the engine's config unchanged (the options are declared once, from EngineConfig)."""

from __future__ import annotations

import dataclasses

import pytest
from serve_process import free_port
from typer.testing import CliRunner

import kvledger.engine.engine as engine_module
from kvledger.cli import app
from kvledger.commands.engine_options import field_help, flag
from kvledger.engine.config import EngineConfig
from kvledger.errors import KVLedgerError

# one non-default value per field, and the command-line words that ask for it
NON_DEFAULT = {
    "model": ("some/model.gguf", ["--model", "some/model.gguf"]),
    "dtype": ("fp32", ["--dtype", "fp32"]),
    "block_size": (32, ["--block-size", "32"]),
    "kv_cache_gib": (0.5, ["--kv-cache-gib", "0.5"]),
    "num_blocks": (77, ["--num-blocks", "77"]),
    "max_num_seqs": (5, ["--max-num-seqs", "5"]),
    "max_num_batched_tokens": (333, ["--max-num-batched-tokens", "333"]),
    "new_prefill_tokens": (100, ["--new-prefill-tokens", "100"]),
    "enable_prefix_caching": (False, ["--no-prefix-caching"]),
    "state_checkpoint_blocks": (3, ["--state-checkpoint-blocks", "3"]),
    "long_prompt_tokens": (900, ["--long-prompt-tokens", "900"]),
    "long_kv_share": (0.25, ["--long-kv-share", "0.25"]),
    "max_kv_tokens_per_request": (4096, ["--max-kv-tokens-per-request", "4096"]),
    "use_kv_cache": (False, ["--no-kv-cache"]),
    "device": ("cuda", ["--device", "cuda"]),  # resolved by the engine (faked here)
    "num_threads": (2, ["--threads", "2"]),
    "attention": ("reference", ["--attention", "reference"]),
    "kv_policy": ("h2o", ["--kv-policy", "h2o"]),
    "kv_window": (8, ["--kv-window", "8"]),
    "kv_sinks": (2, ["--kv-sinks", "2"]),
    "kv_budget": (64, ["--kv-budget", "64"]),
    "kv_positions": ("original", ["--kv-positions", "original"]),
    "kv_select": ("per-sequence", ["--kv-select", "per-sequence"]),
    "kv_scope": ("prompt", ["--kv-scope", "prompt"]),
    "kv_cache_dtype": ("int4", ["--kv-cache-dtype", "int4"]),
    "kv_group_size": (16, ["--kv-group-size", "16"]),
    "kv_key_quant": ("per-token", ["--kv-key-quant", "per-token"]),
    "kv_outlier_channels": (4, ["--kv-outlier-channels", "4"]),
    "kv_rotation": ("hadamard", ["--kv-rotation", "hadamard"]),
    "kv_key_group_tokens": (32, ["--kv-key-group-tokens", "32"]),
    "kv_residual_tokens": (64, ["--kv-residual-tokens", "64"]),
    "kv_intact_tokens": (32, ["--kv-intact-tokens", "32"]),
    "kv_calibration": ("calib.json", ["--kv-calibration", "calib.json"]),
    "tensor_parallel_size": (3, ["-tp", "3"]),
    "tp_timeout_s": (5.0, ["--tp-timeout-s", "5"]),
    "load_format": ("dummy", ["--load-format", "dummy"]),
    "kv_disk_dir": ("kv-dir", ["--kv-disk-dir", "kv-dir"]),
    "kv_disk_gib": (2.0, ["--kv-disk-gib", "2"]),
    "kv_ram_gib": (0.5, ["--kv-ram-gib", "0.5"]),
    "grammar_cache_mib": (64, ["--grammar-cache-mib", "64"]),
    "max_grammar_bytes": (4096, ["--max-grammar-bytes", "4096"]),
    "max_schema_properties": (10, ["--max-schema-properties", "10"]),
    "max_grammar_alternatives": (20, ["--max-grammar-alternatives", "20"]),
    "kv_events_config": ('{"enable_kv_cache_events": false}',
                         ["--kv-events-config", '{"enable_kv_cache_events": false}']),
    "speculative_config": ('{"method": "off"}', ["--speculative-config", '{"method": "off"}']),
}
FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


COMMANDS = {"generate": ["generate", "hi"], "serve": ["serve", "--port", str(free_port())]}


class _Stop(KVLedgerError):
    """Raised by the fake engine once it has seen its config (the command exits 2)."""


@pytest.fixture
def seen(monkeypatch):
    configs = []

    def fake_engine(config):
        configs.append(config)
        raise _Stop("stop")

    monkeypatch.setattr(engine_module, "LLMEngine", fake_engine)
    return configs


def test_the_table_covers_every_field_and_every_field_has_help():
    assert set(NON_DEFAULT) == set(FIELDS)
    assert {n: bool(field_help().get(n)) for n in FIELDS} == {n: True for n in FIELDS}
    for name, (value, _) in NON_DEFAULT.items():
        field = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
        assert value != field.default, name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_reaches_the_config(command, seen):
    words = [w for name in FIELDS for w in NON_DEFAULT[name][1]]
    result = CliRunner().invoke(app, [*COMMANDS[command], *words])
    assert result.exit_code == 2 and "error: stop" in result.output, result.output
    assert seen == [EngineConfig(**{n: NON_DEFAULT[n][0] for n in FIELDS})]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_defaults_are_the_config_defaults(command, seen):
    result = CliRunner().invoke(app, COMMANDS[command])
    assert result.exit_code == 2, result.output
    assert seen == [EngineConfig()]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_every_flag(command):
    text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    for name in FIELDS:
        assert flag(name) in text, (command, name)


def test_bad_values_are_one_line_errors(seen):
    result = CliRunner().invoke(app, ["generate", "hi", "--long-kv-share", "1.5"])
    assert result.exit_code == 2 and "--long-kv-share must be a number in (0, 1]" in result.output
    assert seen == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value, named", [
    ('{"method": "ngram", "num_speculative_tokenz": 3}', "unknown key 'num_speculative_tokenz'"),
    ('{"method": "mtp"}', "method 'mtp' is not supported"),
    ('{"method": "draft_model"}', "method 'draft_model' needs the key 'model'"),
    ('{"method": "ngram", "model": "default"}', "key 'model' is the draft model"),
    ('{"method": "draft_model", "model": "/no/such/draft"}', "model not found: /no/such/draft"),
    ("{method: ngram}", "not valid JSON"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min must be an integer"),
])
def test_bad_speculative_configs_are_one_line_errors(seen, command, value, named):
    result = CliRunner().invoke(app, [*COMMANDS[command], "--speculative-config", value])
    assert result.exit_code == 2, result.output
    assert "error: speculative_config" in result.output and named in result.output
    assert seen == []


def test_an_unwritable_kv_disk_dir_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from kvledger.model.weights import loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_weights", no_load)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["generate", "hi", "--kv-disk-dir", str(blocker / "kv")])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: --kv-disk-dir {blocker / 'kv'}: cannot create or write it (Not a directory)"]
