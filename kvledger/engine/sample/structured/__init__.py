"""Structured output: constraints (``constraint.py``), their compiled and cached grammars
(``compiler.py``) and the per-step token masks (``masks.py``)."""
