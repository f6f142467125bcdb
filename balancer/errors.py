"""The error hierarchy (pure).

::

    BalancerError
    ├── ConfigError               bad settings, found at start-up or on a policy update
    ├── DrainCommitError          a drain the fleet's Redis did not store (applied nowhere: 503)
    ├── EventDecodeError          a malformed engine event or frame (carries a machine-readable reason)
    ├── NoReplicasAvailable       nothing healthy to route to
    ├── Overloaded                admission limits reached (maps to 429/503 with Retry-After)
    └── UpstreamError             the chosen replica failed
        └── UpstreamTimeout
"""

from __future__ import annotations

import os


class BalancerError(Exception):
    """Base of every error kvlb raises on purpose."""


class ConfigError(BalancerError, ValueError):
    """Settings that cannot work together; the message names the field and the limit."""


class DrainCommitError(BalancerError):
    """A drain or undrain could not reach the fleet (Redis), so it was not applied anywhere (503)."""


class EventDecodeError(BalancerError):
    """An engine event that could not be decoded.

    ``reason`` is a short stable label for metrics (``"msgpack"``, ``"frame"``, ``"schema"``, ...);
    the message gives the detail for logs. Ingest loops count and skip these; they never crash.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class NoReplicasAvailable(BalancerError):
    """No healthy replica can take the request."""


class Overloaded(BalancerError):
    """Admission refused; ``retry_after_s`` is the hint for the client."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(BalancerError):
    """The replica failed (connect error, bad status, broken stream)."""


class UpstreamTimeout(UpstreamError):
    """The replica did not answer within a stage timeout."""


def bind_error(setting: str, host: str, port: int, exc: OSError | OverflowError) -> ConfigError:
    """The one-line error for a listener that could not bind (a port in use, a host that resolves to
    nothing, a port out of range), naming the setting: ``listen.port: cannot bind 127.0.0.1:8000:
    Address already in use``."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno > 0:
        reason = os.strerror(exc.errno)  # uvloop's own message repeats the address
    elif isinstance(exc, OSError) and exc.strerror:
        reason = exc.strerror  # getaddrinfo's (negative errno)
    else:
        reason = str(exc).rstrip(".")
    return ConfigError(f"{setting}: cannot bind {host}:{port}: {reason}")
