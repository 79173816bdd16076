"""The rules that place sliding (or linear-attention) layers among full ones, which families'
``layer_types`` hooks compose (transformers' configuration classes, v4.57 / v5)."""

from __future__ import annotations

from kvledger.spec.config import Config
from kvledger.spec.groups import FULL, SLIDING


def sliding_from(first: int, n: int) -> tuple[str, ...]:
    """Layers ``i >= first`` slide, the others are full (Qwen2's ``max_window_layers``)."""
    return tuple(SLIDING if i >= first else FULL for i in range(n))


def every_nth_full(period: int, n: int, other: str = SLIDING) -> tuple[str, ...]:
    """Layer ``i`` is full when ``(i + 1) % period == 0``, else ``other`` (Gemma 2: period 2;
    Gemma 3: ``sliding_window_pattern``; Qwen3-Next: ``full_attention_interval`` with
    linear-attention layers between)."""
    return tuple(FULL if (i + 1) % period == 0 else other for i in range(n))


def uniform_window(c: Config, n: int) -> tuple[str, ...] | None:
    """Every layer slides when the config sets a ``sliding_window`` (Mistral, Mixtral, Phi-3),
    else no rule (null or false: none; 0 or -1 set one, refused by its range)."""
    window = c.get("sliding_window")
    return None if window is None or window is False else (SLIDING,) * n


def use_sliding_window(c: Config, n: int, first: int | None = None) -> tuple[str, ...] | None:
    """Qwen's rule: no window unless ``use_sliding_window``; then layers from ``first`` (by
    default the config's ``max_window_layers``) slide (transformers' Qwen3-MoE slides every
    layer: ``first`` 0)."""
    if not c.get("use_sliding_window", False):
        return None
    return sliding_from(int(c.get("max_window_layers", 0)) if first is None else first, n)
