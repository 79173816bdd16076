"""The live dashboard: its routes (``routes.py``), the engine snapshot it shows (``stats.py``)
and its static pages and scripts (``assets/``)."""
