"""The live dashboard of ``kvledger serve``: ``/dashboard`` and the planner form ``/dashboard/plan``.

Pages and their script are static files of the package (``assets/``, plain HTML/JS,
with uPlot vendored from npm); they fetch data from the ``/dashboard/api`` routes:

- ``GET /dashboard/api/stats``: pool, block map, requests, latency histograms and alerts
  (:mod:`.stats`), read in the engine thread between two steps; with API keys a
  key sees its own requests only, an ``--admin-api-key`` all of them;
- ``GET /dashboard/api/catalogue``: catalogue ids, device names and KV formats for the form;
- ``POST /dashboard/api/plan``: the planner's JSON (as ``kvledger plan --json``) and its plot.

With ``--api-key`` the ``/dashboard/api`` routes need the key like ``/v1`` (the auth
middleware); the pages themselves hold no data and ask for the key once (kept in the tab's
sessionStorage). Every dashboard response carries a Content-Security-Policy that lets the page
load and connect to this server only, so it can send nothing to another host.
"""

from __future__ import annotations

import asyncio
import base64
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import HTMLResponse, JSONResponse, Response

from kvledger.server.auth.middleware import ApiKeyMiddleware
from kvledger.server.auth.tenancy import caller
from kvledger.server.dashboard.stats import (
    alerts,
    counter_values,
    engine_snapshot,
    latency_histograms,
    visible_to,
)
from kvledger.server.openai.error_handlers import error_response

router = APIRouter(include_in_schema=False)
ASSETS = "assets"  # folder of the pages and scripts inside kvledger.server.dashboard
ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "Cache-Control": "no-store",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
_PLOT_LOCK = threading.Lock()
SNAPSHOT_TIMEOUT_S = 30.0  # one engine step (a long prefill chunk on CPU) must fit in this


def _asset(name: str) -> bytes | None:
    """Bytes of a packaged dashboard file, None when there is no such plain file name."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    item = resources.files("kvledger.server.dashboard").joinpath(ASSETS, name)
    return item.read_bytes() if item.is_file() else None


def _auth_required(request: Request) -> bool:
    return any(m.cls is ApiKeyMiddleware for m in request.app.user_middleware)


def _page(request: Request, name: str, label: str) -> HTMLResponse:
    """Page ``name`` with the shared key form (its button says "Open ``label``")."""
    login = _asset("login.html").decode().replace("{{PAGE}}", label)
    html = _asset(name).decode().replace("{{LOGIN}}", login)
    html = html.replace("{{AUTH}}", "required" if _auth_required(request) else "none")
    return HTMLResponse(html, headers=HEADERS)


@router.get("/dashboard")
async def dashboard(request: Request) -> HTMLResponse:
    """The live dashboard page."""
    return _page(request, "dashboard.html", "dashboard")


@router.get("/dashboard/plan")
async def plan_page(request: Request) -> HTMLResponse:
    """The planner as a form."""
    return _page(request, "plan.html", "planner")


@router.get("/dashboard/assets/{name}")
async def asset(name: str) -> Response:
    """A script, style sheet or license of the dashboard."""
    data = _asset(name)
    if data is None:
        return error_response(404, f"no dashboard asset {name!r}", "not_found")
    media = ASSET_TYPES.get(Path(name).suffix, "text/plain")
    return Response(data, media_type=media, headers=HEADERS)


@router.get("/dashboard/api/stats")
async def stats(request: Request) -> JSONResponse:
    """One snapshot: ``time`` (Unix s), ``model``, ``engine_alive``, ``pool``, ``blocks``,
    ``requests``, ``stats``, ``histograms``, ``counters``, ``alerts`` (see dashboard_stats)."""
    state = request.app.state.server
    alive = state.loop.alive
    if not alive:
        return error_response(503, "the engine thread has stopped", "engine_dead")
    try:
        who = caller(request)
        tenant = None if who.admin else who.tenant
        snap = await asyncio.wait_for(state.loop.call(lambda engine: visible_to(
            engine_snapshot(engine), state.loop.owners(), tenant)), SNAPSHOT_TIMEOUT_S)
    except TimeoutError:
        return error_response(503, "the engine did not answer in time; retry", "engine_busy")
    registry = state.metrics.registry
    counters = counter_values(registry)
    snap.update(time=time.time(), model=state.model_name, engine_alive=alive,
                max_model_len=state.max_model_len, histograms=latency_histograms(registry),
                counters=counters, alerts=alerts(snap, counters, alive))
    return JSONResponse(snap, headers=HEADERS)


@router.get("/dashboard/api/catalogue")
async def catalogue() -> JSONResponse:
    """Model ids (with KV figures), device names and KV formats the plan form offers."""
    from kvledger.ledger.hardware import DEVICES
    from kvledger.ledger.kv_format import KV_FORMATS
    from kvledger.model.catalogue import catalogue_rows

    rows = await asyncio.to_thread(catalogue_rows)
    return JSONResponse({"models": rows, "devices": list(DEVICES), "kv_formats": KV_FORMATS},
                        headers=HEADERS)


class PlanRequest(BaseModel):
    """The plan form: a catalogue id (or a path on the server), device and options."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1, max_length=300)
    device: str = "H100-SXM"
    context: str = Field("2048,8192,32768,131072", max_length=200)
    kv_dtype: str = "bf16"
    tp: int = Field(1, ge=1, le=1024)
    plot: bool = True


def _plan(body: PlanRequest) -> dict:
    """The plan of a catalogue model (never a path: the form must not read server files)."""
    from kvledger.ledger.hardware import get_device
    from kvledger.ledger.planner import PlanOptions, parse_contexts, plan
    from kvledger.model.catalogue import catalogue_spec, lookup

    spec = catalogue_spec(lookup(body.model))
    device = get_device(body.device)
    options = PlanOptions(contexts=parse_contexts(body.context), kv_format=body.kv_dtype,
                          tp=body.tp)
    out = {"plan": plan(spec, device, options).to_json()}
    if body.plot:
        from kvledger.ledger.plan_plot import write_plot

        with _PLOT_LOCK, tempfile.TemporaryDirectory() as tmp:  # pyplot is not thread-safe
            png = Path(tmp) / "plan.png"
            write_plot(spec, device, options, png)
            out["plot_png"] = base64.b64encode(png.read_bytes()).decode()
    return out


@router.post("/dashboard/api/plan")
async def plan_route(body: PlanRequest) -> JSONResponse:
    """``kvledger plan MODEL --json`` for a catalogue model, plus the PNG plot (base64)."""
    return JSONResponse(await asyncio.to_thread(_plan, body), headers=HEADERS)
