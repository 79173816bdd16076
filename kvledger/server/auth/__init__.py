"""Who may call: the API keys (``api_keys.py``), their check (``middleware.py``) and the tenant
of a key (``tenancy.py``)."""
