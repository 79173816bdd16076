"""``kvledger serve``: CLI flags reach EngineConfig and the app; uvicorn gets host and port."""

import socket
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import kvledger.engine.engine as engine_module
from kvledger.cli import app
from kvledger.server.lifecycle import DrainingServer


def test_flags_reach_the_engine_config_and_uvicorn(monkeypatch):
    seen = {}

    def fake_engine(config):
        seen["config"] = config
        return SimpleNamespace(model_name="m", max_model_len=64, tokenizer=None,
                               cache_config={"block_size": "16", "cache_dtype": "bf16"})

    def fake_run(server):
        seen.update(app=server.config.app, host=server.config.host, port=server.config.port,
                    drain_timeout_s=server.drain_timeout_s)

    monkeypatch.setattr(engine_module, "LLMEngine", fake_engine)
    monkeypatch.setattr(DrainingServer, "run", fake_run)
    with socket.socket() as free:  # a port no other test run holds
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = CliRunner().invoke(app, [
        "serve", "--port", str(port), "--block-size", "32", "--kv-cache-gib", "0.5",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--no-prefix-caching",
        "--long-prompt-tokens", "1000", "--long-kv-share", "0.25",
        "--max-kv-tokens-per-request", "4096", "--api-key", "k", "--max-queue", "3",
        "--kv-alert-bytes", "1000", "--request-timeout-s", "9", "--max-concurrent-streams", "5",
        "--max-stop-strings", "3", "--max-body-bytes", "1000", "--drain-timeout-s", "7",
        "--served-model-name", "served",
    ])
    assert result.exit_code == 0, result.output
    c = seen["config"]
    assert (c.model, c.block_size, c.kv_cache_gib, c.max_num_seqs) == ("default", 32, 0.5, 8)
    assert (c.max_num_batched_tokens, c.enable_prefix_caching) == (512, False)
    assert (c.long_prompt_tokens, c.long_kv_share, c.max_kv_tokens_per_request) == (
        1000, 0.25, 4096)
    assert (seen["host"], seen["port"]) == ("127.0.0.1", port)  # loopback by default
    assert seen["app"].state.server.model_name == "served"  # --served-model-name wins
    limits = seen["app"].state.server.limits
    assert (limits.request_timeout_s, limits.max_concurrent_streams, limits.max_stop_strings,
            limits.max_body_bytes) == (9, 5, 3, 1000)
    assert seen["drain_timeout_s"] == 7


def test_a_missing_model_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "nope.gguf")])
    assert result.exit_code == 2
    assert "error: model path not found" in result.output


@pytest.mark.parametrize("model_id,model_type", [("openai-community/gpt2", "gpt2"),
                                                 ("deepseek-ai/DeepSeek-V3", "deepseek_v3")])
def test_a_plan_only_family_is_refused_by_name(model_id, model_type):
    result = CliRunner().invoke(app, ["serve", "--model", model_id, "--load-format", "dummy"])
    assert result.exit_code == 2
    line, = result.output.strip().splitlines()
    assert f"model_type '{model_type}'" in line and "it runs llama" in line


def test_chat_template_file_replaces_the_models(monkeypatch, tmp_path):
    seen = {}
    tokenizer = SimpleNamespace(chat_template="the model's")

    def fake_engine(config):
        return SimpleNamespace(model_name="m", max_model_len=64, tokenizer=tokenizer,
                               cache_config={"block_size": "16", "cache_dtype": "bf16"})

    monkeypatch.setattr(engine_module, "LLMEngine", fake_engine)
    monkeypatch.setattr(DrainingServer, "run", lambda server: seen.setdefault("ran", True))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    result = CliRunner().invoke(app, ["serve", "--port", str(port), "--chat-template",
                                      str(template)])
    assert result.exit_code == 0, result.output
    assert seen["ran"] and tokenizer.chat_template == template.read_text()


@pytest.mark.parametrize("content", [None, "  \n"])
def test_an_unreadable_or_empty_chat_template_is_a_one_line_error(tmp_path, content):
    template = tmp_path / "t.jinja"
    if content is not None:
        template.write_text(content)
    result = CliRunner().invoke(app, ["serve", "--chat-template", str(template)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --chat-template: "), result.output
