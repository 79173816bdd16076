"""``pip install .`` into a fresh venv, then the installed package (not the source tree) plans
a catalogue model and serves the dashboard.

The venv reuses the already installed dependencies (torch 2.13.0 CPU, pip, setuptools and the
rest) through a ``.pth`` line naming their site-packages, so nothing is downloaded; that line adds the folder
without running its ``.pth`` files, so an editable install of the checkout stays out of sight.
The source is copied first so the build writes nothing into the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
from browser import served as serve_bundled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*cache",
                              ".hypothesis", "bench-out", "out", "tests", "docs")


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    assert r.returncode == 0, f"{cmd}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin folder, environment, a working folder outside the checkout)."""
    import torch

    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    venv = tmp / "venv"
    # no pip of its own (ensurepip's old setuptools would shadow the installed one): the
    # installed pip runs under the new interpreter and installs into the new venv
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    deps = Path(torch.__file__).resolve().parents[1]
    site = Path(subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz-installed-deps.pth").write_text(f"{deps}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_NO_INDEX"] = "1"  # nothing to download: a missing dependency fails loudly
    bin_dir = venv / "bin"
    # --no-deps / --ignore-installed: the reused folder already holds the dependencies (and may
    # hold an editable kvledger, which pip must not try to uninstall)
    run([bin_dir / "python", "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed",
         "--no-build-isolation", "."], cwd=src, env=env)
    work = tmp / "elsewhere"
    work.mkdir()
    assert sysconfig.get_path("purelib") != str(site)
    return bin_dir, env, work, site


def test_installed_package_comes_from_the_wheel(installed):
    bin_dir, env, work, site = installed
    where = run([bin_dir / "python", "-c", "import kvledger; print(kvledger.__file__)"],
                cwd=work, env=env)
    assert Path(where.strip()).is_relative_to(site)
    for data in ("data/configs/SOURCES.md", "data/configs/meta-llama__Llama-3.1-8B.json",
                 "server/dashboard/assets/uPlot.iife.min.js",
                 "server/dashboard/assets/uPlot.LICENSE.txt",
                 "server/dashboard/assets/dashboard.html"):
        assert (site / "kvledger" / data).is_file(), data
    assert run([bin_dir / "kvledger", "--version"], cwd=work, env=env).startswith("kvledger ")
    assert run([bin_dir / "python", "-m", "kvledger", "--version"], cwd=work, env=env).strip() \
        == run([bin_dir / "kvledger", "--version"], cwd=work, env=env).strip()


def test_installed_plan_of_an_hf_id(installed):
    bin_dir, env, work, _ = installed
    out = json.loads(run([bin_dir / "kvledger", "plan", "meta-llama/Llama-3.1-8B", "--json"],
                         cwd=work, env=env))
    assert out["model"] == "meta-llama/Llama-3.1-8B"
    assert out["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # bf16, from the model card


def test_installed_serve_has_the_dashboard(installed):
    bin_dir, env, work, _ = installed
    os.chdir(work)
    served = serve_bundled(work / "serve.log", "--kv-cache-gib", "0.02", "--dtype", "fp32",
                            command=[str(bin_dir / "kvledger")], env=env)
    try:
        page = httpx.get(served.url + "/dashboard", timeout=30)
        assert page.status_code == 200 and "block map" in page.text.lower()
        lib = httpx.get(served.url + "/dashboard/assets/uPlot.iife.min.js", timeout=30)
        assert lib.status_code == 200 and len(lib.content) > 10_000
        stats = httpx.get(served.url + "/dashboard/api/stats", timeout=30).json()
        assert stats["pool"]["blocks_total"] == 29
    finally:
        served.close()
