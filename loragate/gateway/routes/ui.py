"""The status page: ``GET /ui`` and its files, and ``GET /`` sending browsers there.

The page is static HTML, CSS and JavaScript shipped in the package (``gateway/ui/``): no
build step, nothing from a CDN. Everything it shows it reads from the gateway's own API with
the caller's key, so it can do exactly what that key may do and no more: the page itself is
public, holds no data, and sets no cookie. A strict Content-Security-Policy keeps it to its
own scripts and its own origin.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import RedirectResponse, Response

router = APIRouter(include_in_schema=False)

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"}


@cache
def page_files() -> dict[str, bytes]:
    """The page's files by name, read once from the installed package."""
    folder = resources.files("loragate.gateway") / "ui"
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in CONTENT_TYPES:
            files[entry.name] = entry.read_bytes()
    return files


def _file_response(name: str) -> Response:
    body = page_files().get(name)
    if body is None:
        raise StarletteHTTPException(404)
    suffix = "." + name.rsplit(".", 1)[-1]
    return Response(body, media_type=CONTENT_TYPES[suffix], headers=PAGE_HEADERS)


@router.get("/ui")
async def status_page() -> Response:
    return _file_response("index.html")


@router.get("/ui/{name}")
async def status_page_file(name: str) -> Response:
    return _file_response(name)


def wants_html(request: Request) -> bool:
    """A browser navigating asks for HTML (``Accept: text/html,...``); API clients do not."""
    return "text/html" in request.headers.get("accept", "").lower()


# Every method, so that what is not a browser's GET gets the 404 it got before this route.
@router.api_route("/", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"])
async def root(request: Request) -> Response:
    """Browsers go to the status page; every other client gets what it got before (404)."""
    if request.method not in ("GET", "HEAD") or not wants_html(request):
        raise StarletteHTTPException(404)
    return RedirectResponse(request.scope.get("root_path", "") + "/ui", status_code=307)
