"""kvledger: an LLM inference engine built around an exact KV-cache ledger.

``from kvledger import LLM, SamplingParams`` gives the offline Python API; the names are loaded
lazily so ``import kvledger.ledger`` never pulls in torch.
"""

from __future__ import annotations

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvledger.engine.llm",
    "LLMEngine": "kvledger.engine.engine",
    "SamplingParams": "kvledger.engine.sample.sampling_params",
    "RequestOutput": "kvledger.engine.output.request_output",
    "EngineConfig": "kvledger.engine.config",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
