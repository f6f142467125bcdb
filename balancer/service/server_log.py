"""The logger of the HTTP server's connection handler (I/O: configures one ``logging`` logger).

aiohttp logs a request it cannot parse (a header over 8 KiB, too many headers, a broken request line)
at ERROR with a traceback whose message quotes the offending bytes: a client's ``Authorization`` or
``Cookie`` value lands in the log, and any client can flood it. The records of such parse errors are
rewritten to one INFO line naming the error class and status, without the bytes or the traceback.
So is its "Unhandled exception" record of a body it cannot decode (a ``Content-Encoding: gzip`` body
that is not gzip), which it logs at ERROR with a traceback for any request, ``GET /healthz``
included, when it reads the rest of the body after the answer.
Errors in kvlb's own handlers are left as they are.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web import RequestPayloadError

LOGGER_NAME = "balancer.http.server"


class ParseErrorFilter(logging.Filter):
    """Turns aiohttp's "Error handling request" records for malformed requests, and its "Unhandled
    exception" records for a body it could not decode (met again when it reads what is left of the
    body after the answer), into one safe line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, RequestPayloadError):  # the answer (400, or any) went out already
            cause = error.__cause__
            record.msg = "malformed request body dropped: %s"
            record.args = (type(cause or error).__name__,)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        elif isinstance(error, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "malformed request from %s refused: %s (HTTP %s)"
            record.args = (remote, type(error).__name__, error.code)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def server_logger() -> logging.Logger:
    """The logger to hand to ``web.AppRunner(logger=...)`` (its filter is installed once)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(f, ParseErrorFilter) for f in logger.filters):
        logger.addFilter(ParseErrorFilter())
    return logger
