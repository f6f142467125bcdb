"""The web console's static files (data, no I/O at import): ``static/`` holds the page served at
``/ui`` (:mod:`balancer.api.webui`), written by hand with no build step and no third-party code.

:data:`STATIC_FILES` names every file and its media type; nothing else under ``static/`` is served.
"""

from __future__ import annotations

from importlib import resources

STATIC_FILES: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
"""File name → ``Content-Type`` of every file the console serves."""


def read_static(name: str) -> bytes:
    """The bytes of one of :data:`STATIC_FILES` (shipped as package data)."""
    if name not in STATIC_FILES:
        raise KeyError(name)
    return resources.files(__package__).joinpath("static", name).read_bytes()
