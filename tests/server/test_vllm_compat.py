"""vLLM's control endpoints and metric names (kvledger.server.vllm_compat, .vllm_metrics).

Expected names, labels and bodies are vLLM's (``v1/metrics/loggers.py``,
``entrypoints/openai/api_server.py``) and the Gateway API Inference Extension's model-server
protocol (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` / the older
``vllm:gpu_cache_usage_perc``, ``vllm:cache_config_info`` with ``block_size`` and
``num_gpu_blocks``), written out here by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from fake_engine import TEXT, FakeEngine
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import kvledger
from kvledger.cli import app as cli
from kvledger.server.vllm_compat import VllmCompat

KEY = {"Authorization": "Bearer k"}


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_reset_prefix_cache_needs_an_admin_key_and_drops_every_tenants_blocks(make_client):
    engine = FakeEngine()
    client = make_client(engine, api_key="k", admin_api_key="adm")
    admin = {"Authorization": "Bearer adm"}
    prompt = {"prompt": "x" * 40, "max_tokens": 1}  # 2 full blocks of 16 per tenant
    for headers in (KEY, admin):
        assert client.post("/v1/completions", json=prompt, headers=headers).status_code == 200
    assert len(engine.cached_blocks) == 4  # salted apart: each tenant's own 2 blocks
    assert client.post("/reset_prefix_cache").status_code == 401
    r = client.post("/reset_prefix_cache", headers=KEY)
    assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
    assert len(engine.cached_blocks) == 4
    r = client.post("/reset_prefix_cache", headers=admin)
    assert r.status_code == 200 and r.json() == {"success": True, "evicted_blocks": 4}
    r = client.post("/v1/completions", json=prompt, headers=KEY)
    assert r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0


def test_reset_prefix_cache_without_keys(make_client):
    engine = FakeEngine()
    client = make_client(engine)
    client.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 1})
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True, "evicted_blocks": 2}


def test_profiler_routes_need_an_admin_key(make_client, tmp_path):
    client = make_client(api_key="k", admin_api_key="adm",
                         vllm=VllmCompat(profile_dir=str(tmp_path)))
    for path in ("/start_profile", "/stop_profile"):
        assert client.post(path, headers=KEY).status_code == 403


def test_profiler_routes_without_profile_dir_name_the_option(make_client):
    client = make_client()
    for path in ("/start_profile", "/stop_profile"):
        r = client.post(path)
        assert r.status_code == 404 and "--profile-dir" in r.json()["error"]["message"]


class _TorchEngine(FakeEngine):
    """A fake engine whose steps run one torch matmul (something for the profiler to see)."""

    def step(self):
        torch.ones(8, 8) @ torch.ones(8, 8)
        return super().step()


def test_profile_records_the_engine_thread_into_a_chrome_trace(make_client, tmp_path):
    client = make_client(_TorchEngine(), vllm=VllmCompat(profile_dir=str(tmp_path)))
    assert client.post("/stop_profile").status_code == 409  # nothing runs yet
    assert client.post("/start_profile").status_code == 200
    assert client.post("/start_profile").status_code == 409  # one at a time
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200
    r = client.post("/stop_profile")
    assert r.status_code == 200
    trace = json.loads((tmp_path / r.json()["trace"].rsplit("/", 1)[1]).read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])  # the engine's op
    assert client.post("/stop_profile").status_code == 409


def test_detokenize_and_version(make_client):
    client = make_client()
    r = client.post("/detokenize", json={"tokens": [ord(c) for c in "Hi!"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hi!"}
    assert client.post("/detokenize", json={"tokens": []}).status_code == 400
    r = client.post("/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [72], "model": "x"}).status_code == 404
    assert client.get("/version").json() == {"version": kvledger.__version__}
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "FakeTokenizer" and info["model_max_length"] == 256


def test_metrics_under_vllm_names_only_when_asked(make_client):
    plain = make_client()
    names = {name for name, _ in _samples(plain.get("/metrics").text) if name.startswith("vllm:")}
    assert names == {"vllm:num_requests_waiting", "vllm:num_requests_running",  # what routers
                     "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",  # read, always
                     "vllm:cache_config_info"}
    client = make_client(vllm=VllmCompat(metrics="vllm"))
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == TEXT[:4]
    samples = _samples(client.get("/metrics").text)
    labels = (("engine", "0"), ("model_name", "fake-model"))
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert (name, labels) in samples, name
    success = ("vllm:request_success_total", (*labels[:1], ("finished_reason", "length"),
                                               labels[1]))
    assert samples[success] == 1
    assert samples[("vllm:generation_tokens_total", labels)] == 4
    assert samples[("vllm:prompt_tokens_total", labels)] == 2
    assert samples[("vllm:time_to_first_token_seconds_count", labels)] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", labels)] == 3  # 4 tokens, 3 gaps
    assert samples[("vllm:time_per_output_token_seconds_count", labels)] == 3
    info = [k for k in samples if k[0] == "vllm:cache_config_info"]
    assert len(info) == 1 and dict(info[0][1])["block_size"] == "16"


def test_every_vllm_sample_is_a_copy_of_ours(make_client):
    client = make_client(vllm=VllmCompat(metrics="vllm"))
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    samples = _samples(client.get("/metrics").text)
    ours = {(name.split(":", 1)[1], tuple(k for k in labels if k[0] != "engine")): v
            for (name, labels), v in samples.items() if name.startswith("kvledger:")}
    copies = [(name, labels, v) for (name, labels), v in samples.items()
              if name.startswith("vllm:")]
    assert len(copies) > 20
    renamed = {"gpu_cache_usage_perc": "kv_cache_usage_perc",
               "time_per_output_token_seconds": "inter_token_latency_seconds"}
    for name, labels, value in copies:
        short = name.split(":", 1)[1]
        for old, new in renamed.items():
            short = new + short[len(old):] if short.startswith(old) else short
        plain = tuple(k for k in labels if k[0] != "engine")
        assert ours[(short, plain)] == value, name


def test_bad_vllm_options_are_one_line_errors(tmp_path):
    result = CliRunner().invoke(cli, ["serve", "--metrics-compat", "sglang"])
    assert result.exit_code == 2 and "--metrics-compat takes 'vllm'" in result.output
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(cli, ["serve", "--profile-dir", str(blocker / "sub")])
    assert result.exit_code == 2 and "--profile-dir: cannot create" in result.output


@pytest.mark.slow
def test_live_reset_prefix_cache_ends_the_next_hit(live_server):
    """The bundled model: a repeated prompt hits the prefix cache until a reset drops it."""
    prompt = "The three primary colors of light are red, green and blue. " * 4  # > 2 blocks

    def cached() -> int:
        r = httpx.post(live_server.url + "/v1/completions", headers=live_server.headers,
                       json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    r = httpx.post(live_server.url + "/reset_prefix_cache", headers=live_server.headers)
    assert r.status_code == 403  # a tenant's key may not drop other tenants' blocks
    r = httpx.post(live_server.url + "/reset_prefix_cache", headers=live_server.admin_headers)
    assert r.status_code == 200 and r.json()["evicted_blocks"] > 0
    assert cached() == 0


@pytest.mark.slow
def test_live_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(live_server):
    url, headers = live_server.url, live_server.headers
    tokens = httpx.post(url + "/tokenize", headers=headers, json={"prompt": "Hello world"}).json()
    r = httpx.post(url + "/detokenize", headers=headers, json={"tokens": tokens["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"].endswith("Hello world")
    r = httpx.post(url + "/detokenize", headers=headers, json={"tokens": [49152]})  # vocab 49152
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    info = httpx.get(url + "/tokenizer_info", headers=headers).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]


_FIRST_PROFILE = """
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from kvledger.server.app import create_app
from kvledger.server.vllm_compat import VllmCompat
import sys
with TestClient(create_app(FakeEngine(), vllm=VllmCompat(profile_dir=sys.argv[1]))) as client:
    assert client.post("/start_profile").status_code == 200
    assert client.post("/stop_profile").status_code == 200
"""


def test_first_profile_prints_no_kineto_thread_error(tmp_path):
    """A fresh process (kineto initialises once per process): the first /start_profile runs
    the profiler in the engine thread, and torch's kineto must not print its thread error."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, "-c", _FIRST_PROFILE, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "External init callback" not in done.stdout + done.stderr
