"""OpenAI-compatible HTTP server of kvledger (``kvledger serve``).

``app.create_app(engine)`` builds the FastAPI app: routes (``routes``), request models and the
OpenAI error shape (``protocol``), response/chunk builders (``responses``), SSE and disconnect
handling (``streaming``), the engine thread (``engine_loop``), per-request metrics and logs
(``observer``, ``metrics``), the API key (``auth``) and the body-size cap (``body_limit``).
"""
