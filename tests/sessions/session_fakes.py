"""Fakes of the session tests: the server's fake engine with a chat template.

Tokens are characters (as in ``tests/server/fake_engine.py``); the template renders each
message as ``<|role|>content<|end|>\\n`` and, with no system message, starts with a default
system turn, like SmolLM2's ChatML template. The fake never emits an EOS token, so every
reply is closed by the whole tail ``<|end|>\\n``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from fake_engine import FakeEngine, FakeTokenizer

DEFAULT_SYSTEM = "<|system|>You are a fake.<|end|>\n"


class ChatTokenizer(FakeTokenizer):
    """Code-point tokens and a ChatML-like template."""

    eos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "" if messages and messages[0]["role"] == "system" else DEFAULT_SYSTEM
        text += "".join(f"<|{m['role']}|>{m['content']}<|end|>\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


class ChatFakeEngine(FakeEngine):
    """FakeEngine with a chat template, an EOS set and a settable context."""

    def __init__(self, max_model_len: int = 4096, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokenizer = ChatTokenizer()
        self.spec = SimpleNamespace(eos_token_ids=[0])
        self.max_model_len = max_model_len
        self.salts: dict[str, str | None] = {}

    def add_request(self, request_id, prompt, params, cache_salt=None) -> None:
        super().add_request(request_id, prompt, params, cache_salt)
        self.salts[request_id] = cache_salt
        self.most_live = max(getattr(self, "most_live", 0), len(self.requests))


def openai_client(test_client, api_key: str = "none"):
    """The official ``openai`` client talking to a TestClient."""
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key,
                         http_client=test_client, max_retries=0)
