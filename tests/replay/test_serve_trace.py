"""The server records a trace through TracingEngine: requests, steps, finishes, refusals."""

from __future__ import annotations

import dataclasses

from kvledger.replay.recorder import TracingEngine
from kvledger.replay.trace import TraceWriter, read_trace


def test_server_requests_land_in_the_trace(tiny_engine, app_client, tmp_path):
    engine = tiny_engine()
    path = tmp_path / "serve.jsonl"
    writer = TraceWriter(path, "serve", engine.model_name, False, engine.config.block_size,
                         dataclasses.asdict(engine.config), engine.scheduler.kv.pool.num_blocks)
    client = app_client(TracingEngine(engine, writer))
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [3, 4, 5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True,
            "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200
    too_long = body | {"prompt": [3] * 600}  # the tiny model's context is 512
    assert client.post("/v1/completions", json=too_long).status_code == 400
    trace = read_trace(path)
    (req,) = trace.requests
    assert req.prompt_token_ids == [3, 4, 5, 6, 7, 8] and req.max_tokens == 5
    assert req.sampling == {"temperature": 0.0, "ignore_eos": True}
    assert req.finish["output_tokens"] == 5 and len(req.finish["output_token_ids"]) == 5
    assert req.finish["ttft_s"] > 0 and req.finish["reason"] == "length"
    assert len(trace.refused) == 1 and "context" in trace.refused[0]["error"]
    computed = sum(n for s in trace.steps for rid, _, n in s["chunks"] if rid == req.id)
    assert computed == 6 + 4  # the prompt, then each sampled token but the last is fed back


def test_an_unwritable_trace_path_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kvledger.cli import app

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvledger.engine.engine.LLMEngine", no_load)
    missing = tmp_path / "no-such-folder" / "t.jsonl"
    r = CliRunner().invoke(app, ["serve", "--port", "8765", "--trace", str(missing)])
    assert r.exit_code == 2, r.output
    assert "--trace: cannot write" in r.output and "no-such-folder" in r.output
