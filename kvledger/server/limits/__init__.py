"""The limits of ``kvledger serve``: the settings (``server_limits.py``) and where each is
enforced: connection (``connection.py``), body (``body.py``) and parsed input
(``input_size.py``)."""
