"""The OpenAI Responses API (``/v1/responses``): routes, bodies, output items, and the
counters of its server-side conversations (``session_metrics.py``)."""
