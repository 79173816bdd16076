"""OpenAI-compatible HTTP server of kvledger (``kvledger serve``).

``app.create_app(engine)`` builds the FastAPI app from the rooms below: the OpenAI API
(``openai/``), the Responses API (``responses/``), tools and structured output (``tools/``),
vLLM's control endpoints (``vllm_compat.py``), metrics (``metrics/``), the dashboard
(``dashboard/``), API keys and tenants (``auth/``), limits (``limits/``) and the graceful drain
(``lifecycle.py``). The engine thread (``engine_loop.py``) owns the engine; tokenizing runs in
its own thread (``tokenizer_thread.py``).
"""
