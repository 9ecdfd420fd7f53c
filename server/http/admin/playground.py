"""GET /: the playground page, and its assets, served from package data.

Plain HTML, CSS and JS in `server/http/admin/ui/`: no build step and no CDN, so the page works
offline.
It calls only the public API (`/health`, `/v1/models`, `/v1/models/draft`,
`/v1/chat/completions`), with the keys the user types into it. Off with `server.ui: false`.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from server.http.common.bodies import OffLoopJson
from server.http.common.errors import APIError

UI_PACKAGE, UI_FOLDER = "server.http.admin", "ui"
INDEX = "index.html"
ASSETS = {
    INDEX: "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# The page loads nothing from elsewhere: the browser refuses it, so a stray CDN link fails loudly.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

router = APIRouter(include_in_schema=False, route_class=OffLoopJson)


def asset(name: str) -> Response:
    body = resources.files(UI_PACKAGE).joinpath(UI_FOLDER, name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers={
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    })


@router.get("/")
def playground() -> Response:
    return asset(INDEX)


@router.get("/ui/{name}")
def playground_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no playground asset {name!r}", code="not_found")
    return asset(name)
