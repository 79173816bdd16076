"""Scheduling: the continuous-batching scheduler (``scheduler.py``), the admission rule it asks
before a request is queued (``max_tokens.py``) and what one step decided (``output.py``).
vLLM: ``v1/core/sched/``."""
