"""The web console's static page at ``/ui`` (I/O): the files of :mod:`balancer.console`, served with
security headers.

The page is static and carries no secret, so it loads without the admin token; it shows only a login
box until the SRE enters the token, and everything it shows comes from ``/admin/*`` calls that the
middleware authenticates. The token is kept in the tab's ``sessionStorage`` and sent in the
``Authorization: Bearer`` header: never in a URL, never in a cookie. A foreign page cannot make the
browser attach it (no ambient credential), and admin writes carrying another ``Origin`` are refused
(:func:`balancer.api.middleware.check_origin`), so the console's writes are CSRF-safe.

Every answer has a Content-Security-Policy that allows only this origin's script, style and fetch
targets (no inline script or style, no framing, no form posts), ``X-Content-Type-Options: nosniff``,
``Referrer-Policy: no-referrer`` and ``Cache-Control: no-cache`` with an ``ETag`` (a new kvlb version
is picked up on the next load, an unchanged file costs a 304).
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from balancer.api.errors import ApiError
from balancer.console import STATIC_FILES, read_static

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
"""The headers of every ``/ui`` answer (redirects included)."""


class ConsoleFiles:
    """name → (body, content type, ETag) of every console file, read once when the app is built."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, str, str]] = {}
        for name, content_type in STATIC_FILES.items():
            body = read_static(name)
            self.files[name] = (body, content_type, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


_FILES = web.AppKey("kvlb_ui_files", ConsoleFiles)


async def console_root(request: web.Request) -> web.Response:
    """``/ui`` → ``/ui/``, so that the page's relative links resolve under ``/ui/``."""
    raise web.HTTPPermanentRedirect("/ui/", headers=SECURITY_HEADERS)


async def console_file(request: web.Request) -> web.Response:
    name = request.match_info.get("name") or "index.html"
    found = request.app[_FILES].files.get(name)
    if found is None:
        raise ApiError(404, f"no console file {name[:100]!r}; the console is at /ui/")
    body, content_type, etag = found
    headers = {**SECURITY_HEADERS, "ETag": etag}
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, headers={**headers, "Content-Type": content_type})


def add_ui_routes(app: web.Application) -> None:
    """``GET /ui``, ``/ui/`` and ``/ui/{file}`` (only the files :data:`STATIC_FILES` names)."""
    app[_FILES] = ConsoleFiles()
    app.router.add_get("/ui", console_root)
    app.router.add_get("/ui/", console_file)
    app.router.add_get("/ui/{name}", console_file)
