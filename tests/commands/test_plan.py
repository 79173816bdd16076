"""``kvledger plan`` / ``kvledger probe`` through the real CLI app (typer's CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.data import configs_dir

CONFIGS = configs_dir()
LLAMA = str(CONFIGS / "meta-llama__Llama-3.1-8B.json")


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_tables():
    r = run("plan", LLAMA, "--device", "H100-SXM", "--context", "8192,32k")
    assert r.exit_code == 0, r.output
    for text in (
        "KV per token, by layer kind",
        "128.0 KiB",
        "4.00 GiB",
        "Chat growth",
        "What if the KV",
        "TPOT floor",
    ):
        assert text in r.stdout


def test_json_contract():
    r = run("plan", LLAMA, "--json", "--context", "8192", "--kv-dtype", "fp8")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # fp8 per 16-token block and KV head: 2 x 16 x 128 bytes + an fp32 scale for K and for V
    per_layer_block = 8 * (2 * 16 * 128 + 2 * 4)
    assert out["kv_bytes_per_token"] == 32 * per_layer_block // 16
    assert out["contexts"][0]["context"] == 8192
    assert out["contexts"][0]["kv_bytes_per_sequence"] == 8192 // 16 * 32 * per_layer_block
    assert {"params_total", "params_active", "weights_bytes"} <= set(out)


def test_plot(tmp_path):
    png = tmp_path / "plan.png"
    r = run("plan", str(CONFIGS / "google__gemma-2-9b.json"), "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_custom_device_and_options():
    r = run(
        "plan",
        str(CONFIGS / "openai__gpt-oss-20b.json"),
        "--device",
        "custom",
        "--memory-gib",
        "48",
        "--bandwidth-gbs",
        "900",
        "--tflops",
        "150",
        "--batch",
        "32",
        "--context",
        "8192",
        "--kv-dtype",
        "int4",
        "--kv-group-size",
        "32",
        "--kv-outlier-frac",
        "0.05",
        "--shared-prefix",
        "1000",
        "--tp",
        "2",
        "--weights-dtype",
        "int4",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["device"]["memory_gib"] == 48


def test_no_window_savings_flag():
    args = ("plan", str(CONFIGS / "google__gemma-2-9b.json"), "--context", "8192", "--json")
    aware = json.loads(run(*args).stdout)["contexts"][0]["kv_bytes_per_sequence"]
    full = json.loads(run(*args, "--no-window-savings").stdout)["contexts"][0]
    assert full["kv_bytes_per_sequence"] == int(2.625 * 2**30) > aware


def _one_line_error(r, pattern: str) -> None:
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], r.stderr
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, pattern",
    [
        (("--device", "TPU-v9"), "known devices: H100-SXM"),
        (("--context", "0"), "--context must be positive"),
        (("--context=-4096",), "--context must be positive"),
        (("--context", "lots"), "comma-separated"),
        (("--tp", "3"), "--tensor-parallel-size 3 does not divide"),
        (("--device", "custom", "--memory-gib", "24"), "--device custom needs"),
        (("--kv-dtype", "int5"), "unknown KV format"),
    ],
)
def test_bad_options_are_one_line_errors(args, pattern):
    _one_line_error(run("plan", LLAMA, *args), pattern)


def test_bad_config_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    _one_line_error(run("plan", str(bad)), "not valid JSON")
    bad.write_text(Path(LLAMA).read_text()[:300])
    _one_line_error(run("plan", str(bad)), "not valid JSON")
    _one_line_error(run("plan", str(tmp_path / "missing.json")), "model path not found")
    for key, value, pattern in [("num_hidden_layers", -3, "num_layers must be an integer in"),
                                ("head_dim", -128, "head_dim must be an integer in"),
                                ("num_key_value_heads", 0, "num_kv_heads must be an integer in"),
                                ("num_key_value_heads", 7, "not a multiple of the KV heads")]:
        bad.write_text(json.dumps({**json.loads(Path(LLAMA).read_text()), key: value}))
        _one_line_error(run("plan", str(bad)), pattern)
    _one_line_error(run("plan", LLAMA, "--plot", str(tmp_path / "no" / "dir.png")),
                    "cannot write the plot")


def test_context_beyond_max_position_warns_and_runs():
    r = run("plan", str(CONFIGS / "openai-community__gpt2.json"), "--context", "4096")
    assert r.exit_code == 0, r.output
    assert "warning: context 4096 is beyond the model's max_position_embeddings (1024)" in r.stderr


def test_probe_then_plan_on_local(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    r = run("probe", "--buffer-mib", "4", "--matmul-n", "64", "--repeats", "1", "--no-kernels")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "local_device.json").is_file()
    r = run("plan", LLAMA, "--device", "local", "--json", "--context", "1024")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["device"]["name"] == "local"


@pytest.mark.parametrize("names", [("--kv-cache-dtype", "--tensor-parallel-size"),
                                   ("--kv-dtype", "--tp"), ("--kv-cache-dtype", "-tp")])
def test_engine_option_names_and_their_old_aliases(names):
    """``--kv-cache-dtype`` / ``--tensor-parallel-size`` (``-tp``) as the engine and vLLM name
    them; the old ``--kv-dtype`` / ``--tp`` still work. fp8, 2 ranks: 32 layers x 8 / 2 KV
    heads x (2 x 16 x 128 bytes + 2 fp32 scales) per 16-token block, per token."""
    kv, tp = names
    r = run("plan", LLAMA, "--json", "--context", "8192", kv, "fp8", tp, "2")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["options"]["kv_format"], out["options"]["tp"]) == ("fp8", 2)
    assert out["kv_bytes_per_token"] == 32 * 4 * (2 * 16 * 128 + 2 * 4) // 16


def test_the_bundled_model_has_one_name_in_plan_and_serve():
    """The name a client sends to ``serve`` (/v1/models, vLLM's default served name: the file)
    is the name ``plan`` prints, not the GGUF's ``general.name`` ("Smollm2 135M 8k Lc100K ...")."""
    from kvledger.engine.model_load import model_name

    planned = json.loads(run("plan", "default", "--context", "2048", "--json").stdout)["model"]
    assert planned == "SmolLM2-135M-Instruct.Q4_1" == model_name("default")


def test_kv_layout_options_price_the_engine_layout():
    """int4, per-token keys, 4 fp16 outlier key channels: per 16-token block and KV head
    2 x 16 x 64 code bytes + 2 x 16 x 4 groups x 4 B of scales + 16 x 4 x 2 B of outliers."""
    r = run("plan", LLAMA, "--json", "--context", "8192", "--kv-cache-dtype", "int4",
            "--kv-key-quant", "per-token", "--kv-outlier-channels", "4")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["block_bytes"] == 32 * 8 * (2 * 16 * 64 + 2 * 16 * 4 * 4
                                                           + 16 * 4 * 2)
    auto = json.loads(run("plan", LLAMA, "--json", "--kv-cache-dtype", "auto").stdout)
    assert auto["options"]["kv_format"] == "bf16"


def test_key_group_and_window_price_the_engine_layout():
    """int2 on the bundled model (30 layers x 3 KV heads, head_dim 64), keys over 64 tokens:
    per 16-token block and KV head 2 x 16 x 16 code bytes + 64 / 4 channels x 4 B of key
    scales + 16 x 2 groups x 4 B of value scales; concurrency leaves each request a window of
    128 bf16 tokens (8 blocks of 30 x 3 x 2 x 16 x 64 x 2 B)."""
    r = run("plan", "default", "--json", "--context", "4096", "--kv-cache-dtype", "int2",
            "--kv-key-group-tokens", "64", "--kv-residual-tokens", "128", "--kv-intact-tokens", "0")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["block_bytes"] == 30 * 3 * (2 * 16 * 16 + 16 * 4 + 16 * 2 * 4)
    window = 8 * 30 * 3 * 2 * 16 * 64 * 2
    per_request = 4096 // 16 * out["block_bytes"] + window
    assert out["contexts"][0]["max_concurrency"] == out["pool_bytes"] // per_request


@pytest.mark.parametrize("fmt, key_scales", [("int2", 64 // 2 * 4), ("int4", 64 * 4)])
def test_default_key_group_window_and_intact_tokens_are_priced(fmt, key_scales):
    """The defaults (issue 58's best settings): int2 keys over 32 tokens (64 / 2 channels' key
    scales per block), int4 over one block; both a window of 128 tokens (8 bf16 blocks) and 32
    intact tokens (2 blocks) held twice: a reserve of 8 + 2 x 2 bf16 blocks per request."""
    r = run("plan", "default", "--json", "--context", "4096", "--kv-cache-dtype", fmt)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    codes = 2 * 16 * 64 * (2 if fmt == "int2" else 4) // 8
    assert out["block_bytes"] == 30 * 3 * (codes + key_scales + 16 * 2 * 4)
    reserve = (8 + 2 * 2) * 30 * 3 * 2 * 16 * 64 * 2
    per_request = 4096 // 16 * out["block_bytes"] + reserve
    assert out["contexts"][0]["max_concurrency"] == out["pool_bytes"] // per_request


def test_intact_tokens_are_priced_twice_beside_the_window():
    """int2 keys over 64 tokens with 64 intact tokens (one key group, 4 blocks) held for the
    sequence and for a cached one: the request's reserve is the window's 8 blocks plus 2 x 4
    bf16 blocks."""
    r = run("plan", "default", "--json", "--context", "4096", "--kv-cache-dtype", "int2",
            "--kv-residual-tokens", "128", "--kv-intact-tokens", "64")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    reserve = (8 + 2 * 4) * 30 * 3 * 2 * 16 * 64 * 2
    per_request = 4096 // 16 * out["block_bytes"] + reserve
    assert out["contexts"][0]["max_concurrency"] == out["pool_bytes"] // per_request


@pytest.mark.parametrize("args, message", [
    (["--kv-intact-tokens", "-16"], "--kv-intact-tokens must be an integer in [0, 2^31)"),
    (["--kv-key-group-tokens", "24"], "must be a positive multiple of --block-size 16"),
    (["--kv-residual-tokens", "32", "--kv-key-group-tokens", "64"], "at least the key group"),
    (["--kv-group-size", "48"], "divide head_dim 128"),
    (["--kv-outlier-channels", "128"], "--kv-outlier-channels must be in"),
    (["--kv-key-quant", "per-row"], "--kv-key-quant must be one of"),
])
def test_bad_kv_layout_options_exit_2(args, message):
    r = run("plan", LLAMA, "--kv-cache-dtype", "int4", *args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


SMOL = str(CONFIGS / "HuggingFaceTB__SmolLM2-135M.json")
H100_CLASS = ("--device", "custom", "--memory-gib", "80", "--bandwidth-gbs", "2000",
              "--tflops", "100", "--mfu", "0.4")


def test_disk_read_speed_shows_the_load_or_recompute_crossover():
    """SmolLM2-135M, bf16 KV (23,040 bytes a token) read at 2 GB/s against a prefill at 100
    TFLOPS x 0.4: per token 11.52 µs to load against (2 x 134,515,008 + 69,120 x (n + 1) / 2)
    FLOPs / 40e12 to recompute n tokens, equal at n = 5,549: 5,552 tokens in whole blocks
    (347 blocks of 368,640 bytes)."""
    r = run("plan", SMOL, *H100_CLASS, "--disk-read-gbps", "2", "--json")
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)["tier_crossover"]
    assert (c["tokens"], c["bytes"]) == (5_552, 347 * 368_640)
    assert c["read"] == {"bytes_per_s": 2e9, "file_s": 0.0} and c["flops_per_s"] == 40e12
    r = run("plan", SMOL, *H100_CLASS, "--disk-read-gbps", "2")
    assert "from 5552 tokens (122.0 MiB)" in " ".join(r.stdout.split())
    assert json.loads(run("plan", SMOL, "--json").stdout)["tier_crossover"] is None


def test_the_probed_disk_speed_feeds_the_crossover(tmp_path, monkeypatch):
    from kvledger.ledger.tier_load import save_figures

    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    save_figures(tmp_path / "kv", {"cold_bytes_per_s": 2e9, "warm_bytes_per_s": 9e9},
                 tmp_path / "config")
    r = run("plan", SMOL, *H100_CLASS, "--kv-disk-dir", str(tmp_path / "kv"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tier_crossover"]["tokens"] == 5_552  # the cold figure


@pytest.mark.parametrize("args, message", [
    (["--disk-read-gbps", "0"], "--disk-read-gbps must be a number in (0, 2^30]"),
    (["--disk-read-gbps", "1", "--kv-disk-dir", "/tmp"], "not both"),
    (["--kv-disk-dir", "/nowhere/probed"], "run `kvledger probe --kv-disk-dir"),
])
def test_bad_disk_speed_options_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    r = run("plan", SMOL, *args)
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output
