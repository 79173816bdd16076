"""``kvledger bench``: TTFT / TPOT / ITL curves against any OpenAI-compatible server.

Modules, in the order a run uses them: ``target`` (URL, auth, model discovery), ``prompts``
(real text cut to exact token counts), ``workloads`` (sweep, shared prefix, growing chat),
``runner`` (arrivals and concurrency slots), ``client`` + ``sse`` (one streamed request, timed),
``metrics`` (server /metrics around each level), ``stats`` (percentiles, level summaries),
``anomaly`` (robust trend, jumps, their explanation), ``overlay`` (the ledger's floors),
``plots`` and ``report`` (results.json, results.csv, PNGs, report.html), ``session`` (the
whole run). It talks HTTP only and imports nothing from the engine or the server.
"""
