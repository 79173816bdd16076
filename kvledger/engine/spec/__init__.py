"""Speculative decoding (``speculative_config``): proposals verified in the paged step, gated
by the ledger's step price (``speculator.py`` is the map)."""
