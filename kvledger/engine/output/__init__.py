"""What leaves the engine: the incremental detokenizer with stop strings (``detokenizer.py``)
and the per-step ``RequestOutput`` (``request_output.py``)."""
