"""The ledger, the spec readers and ``kvledger plan`` must run without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvledger.data import config_path

CONFIG = config_path("openai__gpt-oss-20b")


def _torch_free(code: str) -> None:
    check = code + "\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_ledger_and_spec_import_no_torch():
    _torch_free(
        "import kvledger.ledger, kvledger.ledger.kv, kvledger.ledger.kv_format, "
        "kvledger.ledger.params, "
        "kvledger.ledger.hardware, kvledger.ledger.costs, kvledger.ledger.planner, "
        "kvledger.spec, kvledger.data\n"
        "from kvledger.model.families import load_spec\n"
        "from kvledger.ledger.planner import plan\n"
        "from kvledger.ledger.hardware import get_device\n"
        f"plan(load_spec({str(CONFIG)!r}), get_device('H100-SXM'))\n"
    )


def test_plan_command_runs_without_torch():
    _torch_free(
        "from typer.testing import CliRunner\n"
        "from kvledger.cli import app\n"
        f"r = CliRunner().invoke(app, ['plan', {str(CONFIG)!r}, '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
    )


@pytest.mark.slow
def test_gguf_spec_reads_without_torch():
    _torch_free("from kvledger.model.families import load_spec\nload_spec('default')\n")


def test_the_fleet_plan_runs_without_torch():
    _torch_free(
        "from typer.testing import CliRunner\n"
        "from kvledger.cli import app\n"
        "r = CliRunner().invoke(app, ['plan', '--replicas', '2', '--device', 'local', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
    )
