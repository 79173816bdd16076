"""Prometheus metrics of the server (``server_metrics.py``, under vLLM's names with
``vllm_metrics.py``, KV tiers in ``tier_metrics.py``) and the per-request accounting that feeds
them (``observer.py``)."""
