"""Scheduling: the ``Request`` each step works on (``request.py``), its admission rule
(``max_tokens.py``), the continuous-batching scheduler (``scheduler.py``) and what one step
decided (``output.py``). vLLM: ``v1/core/sched/``."""
