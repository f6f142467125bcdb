"""``--target``'s URL, credentials and model: the checks, the masking, ``GET /v1/models`` (I/O).

Shared by ``kvlb loadtest --target`` (:mod:`loadtests.target`) and ``kvlb capacity --target``
(:mod:`loadtests.capacity.target`). The URL is the endpoint's base (``http(s)://HOST:PORT`` with an
optional path prefix); credentials come from one source: ``--api-key-env VAR`` (a bearer key read from
the environment, so that it is on no command line), an ``Authorization`` ``--header``, or the URL's
user info (HTTP Basic). Nothing written by the commands holds them: :func:`redact_argv` and
:func:`redact_url` mask every ``--header`` value and a URL's password as :data:`SECRET_MASK`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

import aiohttp

SECRET_MASK = "***"
"""What a header value or a URL's password is written as in the outputs."""


def parse_headers(pairs: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header expects NAME:VALUE, got {redact_header(pair)!r}")
        headers[name.strip()] = value.strip()
    return headers


def redact_header(pair: str) -> str:
    """``NAME:VALUE`` as ``NAME:***`` (the whole text masked when it has no colon)."""
    name, sep, _ = pair.partition(":")
    return f"{name}:{SECRET_MASK}" if sep else SECRET_MASK


def redact_url(url: str) -> str:
    """``url`` with the password of its user info written as ``***`` (the rest unchanged)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{SECRET_MASK}@{netloc}"))


def redact_argv(argv: Iterable[str]) -> list[str]:
    """The command line with ``--header`` values and URL passwords masked: fit for a report."""
    redacted: list[str] = []
    after_header = False
    for arg in argv:
        if after_header:
            redacted.append(redact_header(arg))
        elif arg.startswith("--header="):
            redacted.append("--header=" + redact_header(arg.removeprefix("--header=")))
        else:
            redacted.append(redact_url(arg))
        after_header = arg == "--header"
    return redacted


def check_target_url(url: str) -> None:
    """``ValueError`` unless ``url`` is ``http(s)://host[:port][/prefix]`` (no query or fragment)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--target {redact_url(url)!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"--target expects http://HOST:PORT or https://HOST:PORT, with an optional path prefix "
            f"such as /v1; got {redact_url(url)!r}"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"--target {redact_url(url)!r}: no query or fragment (requests append a path)")
    if parts.path.rstrip("/").endswith(("/completions", "/models")):
        raise ValueError(
            f"--target {redact_url(url)!r} names an endpoint; give the base URL (http://HOST:PORT or "
            "http://HOST:PORT/prefix/v1): the workload appends /v1/chat/completions or /v1/completions"
        )
    del port


def target_headers(args: argparse.Namespace) -> dict[str, str]:
    """Every request's headers: ``--header`` and, with ``--api-key-env VAR``, the bearer key of
    ``$VAR``. ``ValueError`` for a malformed header, an unset or empty ``VAR``, or two sources of
    credentials (the URL's user info, ``--api-key-env``, an ``Authorization`` header)."""
    headers = parse_headers(args.header)
    sources = [name for name in headers if name.lower() == "authorization"]
    if getattr(args, "api_key_env", None):
        key = os.environ.get(args.api_key_env, "").strip()
        if not key:
            raise ValueError(f"--api-key-env {args.api_key_env}: the variable is not set or empty")
        sources.append(f"--api-key-env {args.api_key_env}")
        headers["Authorization"] = f"Bearer {key}"
    if args.target and urlsplit(args.target).username is not None:
        sources.append("the URL's user info")
    if len(sources) > 1:
        raise ValueError(f"credentials given twice ({', '.join(sources)}): keep one")
    return headers


async def first_model(session: aiohttp.ClientSession, base: str, headers: Mapping[str, str]) -> str:
    """The first model of ``GET /v1/models``; ``ValueError`` (saying to pass ``--model``) when the
    target does not answer that with a JSON list of models."""
    url = base.rstrip("/").removesuffix("/v1") + "/v1/models"
    shown = redact_url(url)
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                raise ValueError(f"GET {shown}: HTTP {response.status}; pass --model")
            data = json.loads(await response.content.read(MODELS_BODY_BYTES))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ValueError(f"GET {shown}: {type(exc).__name__}: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"GET {shown}: the answer is not JSON; pass --model") from None
    listed = data.get("data") if isinstance(data, dict) else None
    models = [m.get("id") for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
    if not models or not isinstance(models[0], str):
        raise ValueError(f"GET {shown} lists no model; pass --model")
    return models[0]


MODELS_BODY_BYTES = 1 << 20
"""Of ``GET /v1/models``' answer, at most this many bytes are read."""
