"""The chat page at `/`: static files shipped in the package (web/), no build step.

The page and its assets are open even on a server with an API key (`PAGE_PATHS` join the
auth middleware's open paths): the page asks the user for the key and sends it with its
own API calls, which stay guarded.
"""

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

WEB_DIR = Path(__file__).with_name("web")
ASSET_PREFIX = "/ui/"
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
                ".svg": "image/svg+xml"}
# Nothing but this origin: no CDN, no inline script, so model output that slipped into
# the DOM as HTML still could not run.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' blob:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_ASSETS = {f"{ASSET_PREFIX}{p.name}": p for p in sorted(WEB_DIR.iterdir())
           if p.suffix in _MEDIA_TYPES and p.name != "index.html"}
PAGE_PATHS = frozenset({"/", *_ASSETS})


def add_web_ui_routes(app: FastAPI) -> None:
    """`GET /` answers the chat page, `GET /ui/<file>` its scripts and style sheet."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return _file(WEB_DIR / "index.html")

    for path, file in _ASSETS.items():
        app.add_api_route(path, _asset_route(file), methods=["GET"], include_in_schema=False)


def _asset_route(file: Path) -> Callable[[], Awaitable[FileResponse]]:
    async def asset() -> FileResponse:
        return _file(file)

    return asset


def _file(path: Path) -> FileResponse:
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=_HEADERS)
