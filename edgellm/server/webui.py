"""The browser pages of `edgellm serve`: a chat at `/` and a live engine dashboard at `/dashboard`.

Both are static files bundled with the package (edgellm/server/static/: plain HTML/JS/CSS and a vendored copy of
marked, MIT licence beside it), so nothing is fetched from the network. The pages carry no data: the chat talks to
our own /v1 endpoints and the dashboard polls /api/dashboard, both behind --api-key when one is set (the pages ask
for the key and keep it in the browser's local storage). `--no-webui` leaves these routes out."""
from __future__ import annotations

import time
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html", "/webui/marked.js": "marked.umd.js"}
MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
# the pages may only talk to this server: no third-party origin can be reached from them
HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                      "script-src 'self' 'unsafe-inline'; img-src 'self' data:",
           "Cache-Control": "no-cache"}


def dashboard_snapshot(state) -> dict:
    """The engine's state now plus the last minute's latency percentiles (what /api/dashboard returns)."""
    llm = state.llm
    s = llm.stats()
    live = state.metrics.live.snapshot()
    seen = max(live["prompt_tokens"], s["prefix_hit_tokens"])
    return {
        "time": time.time(), "model": state.model_id, "ctx_size": state.max_len,
        "running": s["running"], "waiting": max(s["waiting"], state.n_active - s["running"]),
        "kv": {k: s[f"blocks_{k}"] for k in ("total", "used", "cached", "free")},
        "prefix_hit_tokens": s["prefix_hit_tokens"],
        "prefix_hit_rate": s["prefix_hit_tokens"] / seen if seen else 0.0,
        "preemptions": s["preemptions"], **live,
    }


def register_webui(app: FastAPI, state, guarded: list, ready) -> None:
    """Add the pages (no key needed: they hold no data) and /api/dashboard (guarded like /v1)."""

    def page(path: str, name: str):
        async def serve_page():
            return FileResponse(STATIC / name, media_type=MEDIA[Path(name).suffix], headers=HEADERS)

        app.get(path, include_in_schema=False)(serve_page)

    for path, name in PAGES.items():
        page(path, name)

    @app.get("/api/dashboard", dependencies=guarded, include_in_schema=False)
    async def dashboard(s=Depends(ready)):
        return dashboard_snapshot(s)
