"""The OpenAI-compatible API: routes (``routes.py``), request bodies (``protocol.py``,
``protocol_types.py``, ``api_fields.py``), response objects (``formatters.py``), SSE delivery
(``streaming.py``) and the OpenAI error shape (``errors.py``, ``error_handlers.py``,
``validation.py``, ``json_body.py``). vLLM: ``entrypoints/openai/``."""
