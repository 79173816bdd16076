"""``kvledger eval``: what a KV format (or, later, a retention policy) costs in quality.

- :mod:`.perplexity`: llama.cpp's ``llama-perplexity`` protocol through the engine's cache path,
  with the KL divergence against a full-precision-KV run;
- :mod:`.passkey`: a pass key hidden at a depth of filler text, retrieved by greedy decoding.

Every KV choice reaches the engine as one :class:`kvledger.engine.config.EngineConfig` (the
same options as ``generate`` and ``serve``), so a new engine option needs no change here.
"""
