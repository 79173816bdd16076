"""``speculative_config``: vLLM's spelling of the speculative-decoding options.

Given as a dict (``LLM(..., speculative_config={...})``) or as JSON text (``--speculative-config
'{"method": "ngram", "num_speculative_tokens": 4}'``), checked at once: a key that is not one
of :data:`KEYS`, a method we do not run (``mtp``, ``eagle``, ...) or a value out of range is an
``InvalidParameterError`` naming it (the CLI's exit 2, HTTP 400).

Methods (docs/speculative.md):

- ``ngram``: prompt lookup over the request's own prompt and output (``prompt_lookup_min`` to
  ``prompt_lookup_max`` tokens matched, the longest first);
- ``suffix``: a bounded suffix index over this request and the outputs of recent requests
  (SuffixDecoding-style, ``suffix_decoding_max_cached_requests`` requests kept);
- ``draft_model``: a second, smaller model with the target's vocabulary (``model``: a GGUF
  file or a Hugging Face folder) proposes its greedy continuation (``spec/draft_model.py``);
- ``auto``: both lookups, the longer proposal taken; every proposal is gated by the step price
  (``spec/gate.py``), so a step speculates only where the ledger says it pays;
- ``off``: none. ``None`` (no config) is the engine's default, :data:`DEFAULT_METHOD`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import InvalidParameterError

METHODS = ("ngram", "suffix", "draft_model", "auto", "off")
NOT_RUN = {
    "mtp": "multi-token-prediction heads are not run yet",
    "eagle": "EAGLE heads are not run", "eagle3": "EAGLE-3 heads are not run",
    "medusa": "Medusa heads are not run", "mlp_speculator": "MLP speculators are not run",
}
DEFAULT_METHOD = "off"
"""The engine's method when no config is given (docs/speculative.md says why)."""
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
        "suffix_decoding_max_cached_requests", "gate", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Checked speculative-decoding options.

    Attributes:
        method: ``ngram``, ``suffix``, ``draft_model``, ``auto`` or ``off``.
        num_speculative_tokens: most tokens proposed per step and sequence (k).
        prompt_lookup_min, prompt_lookup_max: shortest and longest n-gram matched.
        suffix_decoding_max_cached_requests: finished requests whose outputs the suffix index
            keeps (vLLM's name).
        gate: price each step's proposals and keep only those expected to pay (True), or
            verify every proposal (False: for tests and measurements).
        model: the draft model's path (``draft_model`` only).
    """

    method: str = DEFAULT_METHOD
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_cached_requests: int = 64
    gate: bool = True
    model: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether any proposal is ever made."""
        return self.method != "off"

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig:
        """The config of ``value`` (JSON text, a dict, a config, or None for the default).

        Raises:
            InvalidParameterError: bad JSON, an unknown key, a method not run, a value out of
                range; the message names it.
        """
        if value is None:
            return cls()
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise InvalidParameterError(f"speculative_config is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise InvalidParameterError(
                f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = [k for k in value if k not in KEYS]
        if unknown:
            raise InvalidParameterError(
                f"speculative_config has an unknown key {unknown[0]!r}; known: {', '.join(KEYS)}")
        default = "draft_model" if "model" in value else "ngram" if value else DEFAULT_METHOD
        method = value.get("method", default)
        if method in NOT_RUN:
            raise InvalidParameterError(
                f"speculative_config method {method!r} is not supported: {NOT_RUN[method]}; "
                f"use one of {', '.join(METHODS)}")
        if method not in METHODS:
            raise InvalidParameterError(
                f"speculative_config method must be one of {', '.join(METHODS)}, got {method!r}")
        if ("model" in value) != (method == "draft_model"):
            raise InvalidParameterError(
                "speculative_config method 'draft_model' needs the key 'model' (the draft's "
                "path)" if method == "draft_model" else
                f"speculative_config key 'model' is the draft model of method 'draft_model', "
                f"not of {method!r}")
        fields = {k: v for k, v in value.items() if k != "method"}
        for key, v in fields.items():
            if key == "model":
                if not isinstance(v, str) or not v:
                    raise InvalidParameterError(
                        f"speculative_config model must be a path (text), got {v!r}")
            elif key == "gate":
                if not isinstance(v, bool):
                    raise InvalidParameterError(f"speculative_config gate must be true or false, "
                                                f"got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidParameterError(
                    f"speculative_config {key} must be an integer >= 1, got {v!r}")
        config = cls(method=method, **fields)
        if config.model not in (None, "default") and not Path(config.model).expanduser().exists():
            raise InvalidParameterError(
                f"speculative_config model not found: {config.model} (give a GGUF file, a "
                "folder with config.json, or 'default' for the bundled model)")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise InvalidParameterError(
                f"speculative_config prompt_lookup_min ({config.prompt_lookup_min}) is over "
                f"prompt_lookup_max ({config.prompt_lookup_max})")
        return config
