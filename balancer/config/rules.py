"""The settings' rules that are not a range, as data (pure): value shapes and settings that go
together.

Two tables, two readers, as :data:`~balancer.config.bounds.BOUNDS` for ranges: the settings'
``validate`` methods run every entry (:func:`check_rules`, for a section or one list entry) and the
configuration reference (``docs/configuration.md``) prints every entry from the same tables.

- :data:`SHAPES`: a string setting → its :class:`Shape` (``url(http, https)``, ``zmq endpoint``,
  ``header name`` ...), one checker per shape.
- :data:`TOGETHER`: two settings of one section that must be set together, or one of which needs or
  excludes the other (:class:`Together`), with the message.

The checks that compare list entries with one another stay code, each listed with its description
in :data:`balancer.config.across.ACROSS`.

A new rule that is not a range gets an entry here rather than an ``if`` in ``validate``: then the
reference shows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

from balancer.errors import ConfigError

CORS_MAX_ORIGINS = 64
"""Most entries of ``listen.cors_allow_origins``."""
CORS_MAX_ORIGIN_CHARS = 256
"""Longest entry of ``listen.cors_allow_origins`` (characters)."""
LIBRARY_MAX_CHARS = 4096
"""Longest ``jemalloc_library`` (characters)."""
_HEADER_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_ESCAPE_HINT = "(a password with '/', '?', '#' or '@' goes percent-encoded: '/' as %2F, '@' as %40)"


# ---------------------------------------------------------------------------------------------------
# Shapes: one checker per shape. A checker returns what follows the setting's name in the error
# message (`` must be ...``, ``: at most ...``), or ``None`` when the value fits.


@dataclass(frozen=True, slots=True)
class Shape:
    """The form a string setting's value must have; ``None`` (an unset optional setting) fits."""

    name: str
    """Its short name in the reference (``url(http, https)``)."""
    text: str
    """What it asks for, in words (Markdown)."""
    problem: Callable[[Any], str | None]
    """The rest of the error message after the setting's name for a value that does not fit, else
    ``None``. Never shows a secret (``redis.url``'s password)."""


def _port_ok(parts: Any) -> bool:
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        return False
    return True


def _http_url(value: str) -> str | None:
    parts = urlsplit(value)
    if parts.scheme in ("http", "https") and parts.hostname and _port_ok(parts):
        return None
    return f" must be http(s)://host[:port], got {value[:300]!r}"


def _redis_url(value: str) -> str | None:
    """Host, port and database checked without naming the password. Until 2026-12-01 a port that
    is not a number (often a password with an unencoded ``/``) stopped ``kvlb serve`` with
    redis-py's traceback, and a database that is not one was taken as 0."""
    if not value.startswith(("redis://", "rediss://")):
        return " must start with redis:// or rediss://"
    parts = urlsplit(value)
    if not _port_ok(parts):
        return f": the port is not a number in 0..65535 {_ESCAPE_HINT}"
    if not parts.hostname:
        return f" names no host {_ESCAPE_HINT}"
    database = parts.path.strip("/")
    if database and not database.isdigit():
        return f": the database (after the port) must be a number {_ESCAPE_HINT}"
    return None


def _zmq_endpoint(value: str) -> str | None:
    if value.startswith("tcp://"):
        parts = urlsplit(value)
        if parts.hostname and _port_ok(parts) and parts.port is not None:
            return None
    elif value.startswith("ipc://") and len(value) > len("ipc://"):
        return None
    return f" must be tcp://host:port or ipc://path, got {value[:300]!r}"


def _origins(value: tuple[str, ...]) -> str | None:
    if len(value) > CORS_MAX_ORIGINS:
        return f": at most {CORS_MAX_ORIGINS} origins"
    for origin in value:
        if origin == "*":
            continue
        parts = urlsplit(origin) if len(origin) <= CORS_MAX_ORIGIN_CHARS else None
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.netloc
            or f"{parts.scheme}://{parts.netloc}" != origin
        ):
            return (
                f": {origin[:300]!r} is not an origin: scheme://host[:port],"
                " no path or trailing slash (or '*')"
            )
    return None


def _header_name(value: str) -> str | None:
    if value and set(value) <= _HEADER_CHARACTERS:
        return None
    return " must be a header name (letters, digits, '-', '_')"


def _library(value: str) -> str | None:
    if value and len(value) <= LIBRARY_MAX_CHARS and not any(c.isspace() or c == ":" for c in value):
        return None
    return f" must be a soname or path without whitespace or ':', got {value[:300]!r}"


def _key_prefix(value: str) -> str | None:
    if value and "{" not in value and "}" not in value:
        return None
    return " must be non-empty, without braces"


HTTP_URL = Shape(
    "url(http, https)", "`http://` or `https://`, a host, a port (if any) in 0..65535", _http_url
)
REDIS_URL = Shape(
    "url(redis, rediss)",
    "`redis://` or `rediss://` (TLS), a host, a port (if any) in 0..65535, a database (if any) that"
    " is a number; a password's `/`, `?`, `#` or `@` percent-encoded",
    _redis_url,
)
ZMQ_ENDPOINT = Shape("zmq endpoint", "`tcp://host:port` or `ipc://path`", _zmq_endpoint)
ORIGINS = Shape(
    "origins",
    f"at most {CORS_MAX_ORIGINS} entries, each `*` or an origin `scheme://host[:port]` (`http` or"
    f" `https`, no path or trailing slash, at most {CORS_MAX_ORIGIN_CHARS} characters)",
    _origins,
)
HEADER_NAME = Shape("header name", "not empty; ASCII letters, digits, `-` and `_` only", _header_name)
LIBRARY = Shape(
    "library",
    f"a soname or file path, 1..{LIBRARY_MAX_CHARS:,} characters, no whitespace or `:`"
    " (`LD_PRELOAD` separators)",
    _library,
)
KEY_PREFIX = Shape("key prefix", "not empty, no `{` or `}` (Redis Cluster hash tags)", _key_prefix)

SHAPES: Mapping[str, Shape] = MappingProxyType(
    {
        "listen.cors_allow_origins": ORIGINS,
        "pools[].replicas[].url": HTTP_URL,
        "pools[].replicas[].events": ZMQ_ENDPOINT,
        "pools[].replicas[].replay": ZMQ_ENDPOINT,
        "redis.url": REDIS_URL,
        "redis.key_prefix": KEY_PREFIX,
        "discovery.api_url": HTTP_URL,
        "tenant_header": HEADER_NAME,
        "jemalloc_library": LIBRARY,
    }
)
"""Every string setting with a shape, by dotted YAML path (``[]``: each entry of a list)."""


# ---------------------------------------------------------------------------------------------------
# Settings that go together.


@dataclass(frozen=True, slots=True)
class Condition:
    """What a :class:`Term` asks of its setting's value."""

    state: str
    """The state in words, after ``is`` (``set``, ```file```)."""
    holds: Callable[[Any], bool]
    """Whether a value meets it."""
    verb: str = "be"
    """The verb of :attr:`state` (``be``; ``list`` for a list's entry)."""

    def text(self, mood: Literal["is", "must", "must not"]) -> str:
        """``is set``, ``must be set``, ``must not be set`` (``lists ...``, ``must list ...``)."""
        if mood == "is":
            return f"{'is' if self.verb == 'be' else self.verb + 's'} {self.state}"
        return f"{mood} {self.verb} {self.state}"


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != "" and value != ()


IS_SET = Condition("set", _is_set)
IS_TRUE = Condition("`true`", lambda value: value is True)


def equals(expected: str) -> Condition:
    """The value is ``expected``."""
    return Condition(f"`{expected}`", lambda value: value == expected)


def lists(entry: str) -> Condition:
    """The list holds ``entry``."""
    return Condition(f"`{entry}`", lambda value: entry in value, verb="list")


def url_scheme(scheme: str) -> Condition:
    """The value is a URL of ``scheme``."""
    return Condition(
        f"a `{scheme}://` URL", lambda value: isinstance(value, str) and value.startswith(f"{scheme}://")
    )


def _database_0(value: Any) -> bool:
    return isinstance(value, str) and urlsplit(value).path.strip("/") in ("", "0")


URL_DATABASE_0 = Condition("a URL of database 0 (or of none)", _database_0)


@dataclass(frozen=True, slots=True)
class Term:
    """One side of a :class:`Together`: a setting and what is asked of it."""

    path: str
    """Dotted YAML path (``[]``: each entry of a list)."""
    condition: Condition = IS_SET

    def text(self, mood: Literal["is", "must", "must not"] = "is") -> str:
        """```listen.tls_cert_file`` is set`` (``must be set``, ``must not be set``)."""
        return f"`{self.path}` {self.condition.text(mood)}"


Kind = Literal["together", "needs", "excludes"]


@dataclass(frozen=True, slots=True)
class Together:
    """Two settings of one section (or of one list entry) that must agree."""

    first: Term
    second: Term
    kind: Kind
    """``together``: both hold or neither; ``needs``: ``first`` holds only with ``second``;
    ``excludes``: ``first`` holds only without ``second``."""
    message: str
    """The error (a list entry's is prefixed with the entry: ``pools[m]: ...``)."""

    def text(self) -> str:
        """The rule in words, as the reference prints it."""
        if self.kind == "together":
            return f"{self.first.text()} exactly when {self.second.text()} (both or neither)"
        return f"if {self.first.text()}, {self.second.text('must' if self.kind == 'needs' else 'must not')}"

    def holds(self, first: Any, second: Any) -> bool:
        """Whether the values ``first`` and ``second`` of the two settings keep the rule."""
        a, b = self.first.condition.holds(first), self.second.condition.holds(second)
        if self.kind == "together":
            return a == b
        return not a or (b if self.kind == "needs" else not b)


def _api_keys_either(prefix: str) -> Together:
    return Together(
        Term(f"{prefix}.api_key_file"),
        Term(f"{prefix}.api_key_env"),
        "excludes",
        "set api_key_file or api_key_env, not both",
    )


TOGETHER: tuple[Together, ...] = (
    Together(
        Term("listen.tls_cert_file"),
        Term("listen.tls_key_file"),
        "together",
        "listen.tls_cert_file and listen.tls_key_file must be set together",
    ),
    Together(
        Term("listen.cors_allow_origins", lists("*")),
        Term("listen.cors_allow_credentials", IS_TRUE),
        "excludes",
        "listen.cors_allow_origins: '*' is not allowed with cors_allow_credentials (browsers refuse it):"
        " list the origins",
    ),
    Together(
        Term("redis.tls_ca_file"),
        Term("redis.url", url_scheme("rediss")),
        "needs",
        "redis.tls_ca_file needs a rediss:// redis.url (redis:// is not encrypted)",
    ),
    Together(
        Term("redis.cluster", IS_TRUE),
        Term("redis.url"),
        "needs",
        "redis.cluster needs redis.url (a seed node of the cluster)",
    ),
    Together(
        Term("redis.cluster", IS_TRUE),
        Term("redis.url", URL_DATABASE_0),
        "needs",
        "redis.cluster: the URL's database must be 0 (Redis Cluster has only db 0)",
    ),
    Together(
        Term("discovery.kind", equals("file")),
        Term("discovery.file"),
        "needs",
        "discovery.file is required when discovery.kind is file",
    ),
    _api_keys_either("pools[]"),
    _api_keys_either("pools[].replicas[]"),
)
"""Every pair of settings that must agree, in the order they are checked; both of a pair are in
one section (or one list entry's settings)."""


def _split(path: str) -> tuple[str, str]:
    """``("pools[].replicas[]", "url")`` of ``pools[].replicas[].url``; ``("", "tenant_header")``."""
    parent, _, name = path.rpartition(".")
    return parent, name


def _shapes_at() -> Mapping[str, tuple[tuple[str, str, Shape], ...]]:
    grouped: dict[str, list[tuple[str, str, Shape]]] = {}
    for path, shape in SHAPES.items():
        parent, name = _split(path)
        grouped.setdefault(parent, []).append((path, name, shape))
    return MappingProxyType({parent: tuple(items) for parent, items in grouped.items()})


def _together_at() -> Mapping[str, tuple[tuple[str, str, Together], ...]]:
    grouped: dict[str, list[tuple[str, str, Together]]] = {}
    for rule in TOGETHER:
        parent, first = _split(rule.first.path)
        grouped.setdefault(parent, []).append((first, _split(rule.second.path)[1], rule))
    return MappingProxyType({parent: tuple(items) for parent, items in grouped.items()})


_SHAPES_AT = _shapes_at()
""":data:`SHAPES` by section (read-only, built once from the table): (path, name, shape)."""
_TOGETHER_AT = _together_at()
""":data:`TOGETHER` by section (read-only, built once from the table): (first, second, rule)."""


def check_rules(section: Any, prefix: str, entry: str = "") -> None:
    """Check the :data:`SHAPES` and :data:`TOGETHER` entries of the settings directly in
    ``section``, the dataclass at ``prefix`` (``"redis"``, ``"pools[].replicas[]"``; ``""``: the
    top-level scalars of :class:`Settings`). ``entry`` names a list entry in the messages
    (``replica a``, ``pools[m]``); outside lists the setting's path does."""
    for path, name, shape in _SHAPES_AT.get(prefix, ()):
        value = getattr(section, name)
        problem = None if value is None else shape.problem(value)
        if problem is not None:
            raise ConfigError(f"{entry}: {name}{problem}" if entry else f"{path}{problem}")
    for first, second, rule in _TOGETHER_AT.get(prefix, ()):
        if not rule.holds(getattr(section, first), getattr(section, second)):
            raise ConfigError(f"{entry}: {rule.message}" if entry else rule.message)
