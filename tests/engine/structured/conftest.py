"""Structured-output fixtures: the bundled tokenizer (49,152 ids) and a GrammarCompiler on it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bundled_tokenizer():
    """The bundled SmolLM2 tokenizer (no weights loaded)."""
    from kvledger.engine.loader import load_tokenizer

    return load_tokenizer("default")


@pytest.fixture(scope="session")
def grammars(bundled_tokenizer):
    """One GrammarCompiler for the session (its llguidance tokenizer takes ~2 s to build)."""
    from kvledger.engine.structured.compiler import GrammarCompiler

    return GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer),
                           [bundled_tokenizer.eos_token_id])
