"""``kvledger serve`` refuses a bad state DB or key file in one line, before loading a model."""

from __future__ import annotations

import subprocess
import sys

from serve_process import free_port


def _serve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvledger.cli", "serve", "--port", str(free_port()), *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)


def test_corrupt_state_db_is_a_one_line_error(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"not a database at all" * 100)
    done = _serve("--state-db", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and "state DB" in done.stderr
    assert path.read_bytes() == b"not a database at all" * 100


def test_unknown_memory_policy(tmp_path):
    done = _serve("--memory", "forever", "--state-db", str(tmp_path / "s.db"))
    assert done.returncode == 2 and "--memory must be one of full, summary, segment" in \
        done.stderr


def test_missing_keys_file(tmp_path):
    done = _serve("--api-keys-file", str(tmp_path / "nope.txt"))
    assert done.returncode == 2 and "cannot read --api-keys-file" in done.stderr


def test_a_keys_file_without_keys_is_refused_before_the_model_loads(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# no keys yet\n\n")
    done = _serve("--api-keys-file", str(path), "--state-db", str(tmp_path / "s.db"))
    assert done.returncode == 2 and "holds no API key" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
