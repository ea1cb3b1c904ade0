"""The web UI at ``/ui/``: static files shipped inside the package (no CDN: clusters are often offline).
The page only calls the REST API, like any other client."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"


def mount_ui(app: FastAPI) -> None:
    if not (STATIC_DIR / "index.html").is_file():
        raise RuntimeError(f"web UI files are missing from {STATIC_DIR} (package data not installed?)")

    @app.get("/", include_in_schema=False)
    def _root_redirect() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
