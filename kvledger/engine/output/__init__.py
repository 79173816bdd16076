"""What leaves the engine: a token appended to its request's output with the finish reason
(``emit.py``), the incremental detokenizer with stop strings (``detokenizer.py``) and the
per-step ``RequestOutput`` (``request_output.py``)."""
