"""The one loader of settings (pure except :func:`load`, which reads files and the environment).

Precedence, lowest first: defaults → YAML file → environment (``KVLB_*``) → command-line ``--set``.
Nested fields use ``__`` in environment names and ``.`` on the command line::

    KVLB_LISTEN__PORT=9000           kvlb serve --set listen.port=9000
    KVLB_REDIS__URL=redis://r:6379   kvlb serve --set redis.url=redis://r:6379

The environment variables Kubernetes sets for every Service of the namespace (``enableServiceLinks``,
on by default) share the prefix when a Service's name starts with ``kvlb``: ``KVLB_SERVICE_HOST``,
``KVLB_PORT=tcp://10.0.0.1:8000``, ``KVLB_REDIS_PORT_6379_TCP_ADDR``... They are not settings and are
skipped (:data:`SERVICE_LINK`); a name with ``__`` never has their shape, so no setting is lost.

The dataclasses it builds live in :mod:`balancer.config.settings`. This module is the only place that
reads ``os.environ``.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from balancer.config.settings import API_KEY_MAX_BYTES, PoolConfig, ReplicaConfig, Secret, Settings
from balancer.errors import ConfigError

# ---------------------------------------------------------------------------------------------------
# Loading: plain dicts → dataclasses, with type checks and clear messages.


def from_mapping(cls: type[Any], data: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{where}: expected a list")
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        return {str(k): _convert(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is Secret:
        raise ConfigError(
            f"{where}: an API key is never written in the config: name a file (api_key_file) or an"
            " environment variable (api_key_env) that holds it"
        )
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_mapping(tp, value, where)
    return _scalar(tp, value, where)


def _scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # pragma: no cover - schema bug


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty setting name in {dotted!r}")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _parse_value(text: str) -> Any:
    """Values from env or ``--set`` are YAML scalars or flow collections (``[a, b]``, ``{k: v}``)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse value {text!r}: {exc}") from None


SERVICE_LINK = re.compile(
    r"KVLB_(?!.*__)(?:[A-Z0-9_]*_)?"
    r"(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)"
)
"""The names of the variables Kubernetes sets for a Service whose name starts with ``kvlb``
(``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT[_<port name>]``,
``<NAME>_PORT[_<n>_<proto>[_PROTO|_PORT|_ADDR]]``): not settings. None has ``__``, which every
nested setting has, and no top-level setting ends so."""


ENV_PREFIX = "KVLB_"
"""The prefix of every setting's environment variable."""


def environment_name(dotted: str) -> str:
    """The environment variable the loader reads setting ``dotted`` from (``listen.port`` →
    ``KVLB_LISTEN__PORT``): the inverse of :func:`setting_path`. A list's entries have none (their
    list is set whole: ``KVLB_POOLS='[{model: m, ...}]'``)."""
    return ENV_PREFIX + dotted.upper().replace(".", "__")


def setting_path(variable: str) -> str:
    """The dotted setting a ``KVLB_*`` variable sets (``KVLB_LISTEN__PORT`` → ``listen.port``)."""
    return variable[len(ENV_PREFIX) :].lower().replace("__", ".")


def merge_overrides(base: Mapping[str, Any], env: Mapping[str, str], sets: Sequence[str]) -> dict[str, Any]:
    """Apply ``KVLB_A__B=v`` environment entries, then ``a.b=v`` strings, onto a copy of ``base``."""
    tree: dict[str, Any] = _deep_copy(base)
    for key, raw in sorted(env.items()):
        if key.startswith(ENV_PREFIX) and key != "KVLB_CONFIG" and not SERVICE_LINK.fullmatch(key):
            _set_path(tree, setting_path(key), _parse_value(raw))
    for item in sets:
        name, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects name=value, got {item!r}")
        _set_path(tree, name.strip(), _parse_value(raw))
    return tree


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def config_file(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The settings file :func:`load` reads: ``path``, else ``$KVLB_CONFIG``; ``None``: none."""
    if path is not None:
        return str(path)
    return (os.environ if env is None else env).get("KVLB_CONFIG")


@dataclasses.dataclass(frozen=True, slots=True)
class SettingsSource:
    """The settings file as :func:`load_with_source` read it: what the settings were parsed from."""

    path: str
    """The file's name as given (``--config`` or ``$KVLB_CONFIG``)."""
    data: bytes
    """Its bytes, read once: the supervisor of ``kvlb serve --workers N`` hands these very bytes to
    its workers, never the file as it is later (an edit meanwhile would give them other settings)."""


def load(
    path: str | Path | None = None,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Read the YAML file (or ``$KVLB_CONFIG``), apply env and ``--set`` overrides, validate."""
    return load_with_source(path, sets, env)[0]


def load_with_source(
    path: str | Path | None = None,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    data: bytes | None = None,
) -> tuple[Settings, SettingsSource | None]:
    """:func:`load`, and the file's bytes it parsed (``None`` without a file). ``data``: the file's
    bytes as read before (by the image ``kvlb serve`` re-executed itself from), not read again."""
    environ = dict(os.environ) if env is None else dict(env)
    file = config_file(path, environ)
    source = None
    if file is not None and data is not None:
        source = SettingsSource(file, data)
    elif file is not None:
        try:
            source = SettingsSource(file, Path(file).read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read config {file}: {exc.strerror}") from None
    return parse_settings(source, sets, environ), source


def parse_settings(
    source: SettingsSource | None, sets: Sequence[str], environ: Mapping[str, str]
) -> Settings:
    """The settings of ``source`` (none: the defaults) with ``environ``'s ``KVLB_*`` and ``sets``
    applied, validated, API keys read (from the files and variables the settings name)."""
    raw: Any = {}
    if source is not None:
        try:
            raw = yaml.safe_load(source.data.decode("utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config {source.path} is not UTF-8 text: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {source.path} is not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config {source.path if source else None}: top level must be a mapping")
    settings: Settings = from_mapping(Settings, moved_keys(merge_overrides(raw, environ, sets)))
    return with_api_keys(settings.validate(), environ)


def with_api_keys(settings: Settings, environ: Mapping[str, str]) -> Settings:
    """``settings`` with every pool's and replica's ``api_key`` read from its ``api_key_file`` or
    ``api_key_env`` (a replica naming neither takes its pool's). ConfigError names the setting, the
    file or the variable, never the key."""
    pools = []
    for pool in settings.pools:
        default = _api_key(pool, f"pools[{pool.model}]", environ)
        replicas = tuple(
            dataclasses.replace(
                rep, api_key=_api_key(rep, f"pools[{pool.model}].replicas[{rep.id}]", environ) or default
            )
            for rep in pool.replicas
        )
        pools.append(dataclasses.replace(pool, api_key=default, replicas=replicas))
    return dataclasses.replace(settings, pools=tuple(pools))


def _api_key(config: PoolConfig | ReplicaConfig, where: str, environ: Mapping[str, str]) -> Secret | None:
    """The key ``config`` names (``validate`` has refused naming both, `rules.TOGETHER`)."""
    if config.api_key_file is not None:
        source = f"api_key_file {config.api_key_file}"
        try:
            raw = read_api_key_file(config.api_key_file)
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {source}: {exc.strerror}") from None
        key = api_key_text(raw.decode("utf-8", "replace"), where, source)
        return Secret(key, source, config.api_key_file)
    if config.api_key_env is not None:
        source = f"api_key_env {config.api_key_env}"
        if config.api_key_env not in environ:
            raise ConfigError(f"{where}: {source}: the environment variable is not set")
        return Secret(api_key_text(environ[config.api_key_env], where, source), source)
    return None


def read_api_key_file(path: str) -> bytes:
    """The first bytes of an API key file (blocking; enough to tell one too long); OSError as raised."""
    with open(path, "rb") as file:
        return file.read(API_KEY_MAX_BYTES + 1024)


def api_key_text(text: str, where: str, source: str) -> str:
    """The key in ``text`` (surrounding whitespace stripped), or ConfigError naming ``where`` and
    ``source`` (never the key): empty, over :data:`API_KEY_MAX_BYTES`, or not printable ASCII. The
    key watcher checks a rotated key with it too."""
    key = text.strip()
    if not key:
        raise ConfigError(f"{where}: {source} is empty")
    if len(key.encode("utf-8")) > API_KEY_MAX_BYTES:
        raise ConfigError(f"{where}: {source} holds more than {API_KEY_MAX_BYTES} bytes")
    if not all(" " < char <= "~" for char in key):
        raise ConfigError(f"{where}: {source} holds a character other than printable ASCII")
    return key


def moved_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with the settings that moved under their new names: ``console.tenant_header`` (file,
    ``KVLB_CONSOLE__TENANT_HEADER`` or ``--set``) is ``tenant_header``; both, different → ConfigError."""
    console = tree.get("console")
    if isinstance(console, dict) and "tenant_header" in console:
        old = console.pop("tenant_header")
        if "tenant_header" in tree and tree["tenant_header"] != old:
            raise ConfigError(
                f"console.tenant_header ({old!r}) is the old name of tenant_header "
                f"({tree['tenant_header']!r}): set only tenant_header"
            )
        tree["tenant_header"] = old
    return tree


PRELOAD = "LD_PRELOAD"
JEMALLOC_CONF_VARIABLE = "MALLOC_CONF"
JEMALLOC_CONF = "background_thread:true"
"""jemalloc's options when ``MALLOC_CONF`` is not set: a background thread returns freed memory to
the system (after ``dirty_decay_ms``, 10 s). Without it jemalloc purges an arena only while that arena
allocates, so the memory an event flood's decoding freed stayed resident: 1.24–1.26× the RSS before the
flood 30 s after it, against 0.90–1.06× with the thread (``kvlb bench flood``, docs/benchmark-history.md)."""


def jemalloc_found(library: str) -> bool:
    """Whether the dynamic loader can preload ``library``: a path names an existing file; a soname
    (``libjemalloc.so.2``) is looked up with :func:`ctypes.util.find_library` (the loader's cache)."""
    if "/" in library:
        return Path(library).is_file()
    stem = library.removeprefix("lib").partition(".so")[0]
    return bool(stem) and ctypes.util.find_library(stem) is not None


def allocator_environ(
    settings: Settings, environ: Mapping[str, str] | None = None, found: bool | None = None
) -> dict[str, str] | None:
    """The environment ``kvlb serve`` must re-execute itself with for ``settings.allocator``, or
    ``None`` when it runs as it is: the system allocator, jemalloc already preloaded (the re-executed
    process, or a worker: so it re-executes once), or the library not installed (``found``: whether
    the loader can find ``settings.jemalloc_library``; by default :func:`jemalloc_found`). It sets
    ``MALLOC_CONF`` to :data:`JEMALLOC_CONF` unless it is set already."""
    current = dict(os.environ) if environ is None else dict(environ)
    preloaded = current.get(PRELOAD, "")
    library = settings.jemalloc_library
    if settings.allocator == "system" or "jemalloc" in preloaded or library in preloaded:
        return None
    if found is None:
        found = jemalloc_found(library)
    if not found:
        return None
    current[PRELOAD] = f"{preloaded} {library}".strip()
    current.setdefault(JEMALLOC_CONF_VARIABLE, JEMALLOC_CONF)
    return current


TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
"""The environment switch of ``tokenizers``' thread pool (rayon), ``false`` in ``kvlb serve`` unless set."""


def one_thread_per_encode(environ: MutableMapping[str, str] | None = None) -> None:
    """Turn ``tokenizers``' thread pool off in ``environ`` (default ``os.environ``), unless it is set
    there; ``kvlb serve`` calls it before any encode.

    kvlb encodes one text per call (``encode_batch_fast([text])``, for its GIL release), and a batch of
    one gains nothing from the pool: each encode is handed to a pool thread while the caller waits,
    then back. Measured on a 64-token user message (the ``chat_shared`` kind's new text): 73 µs of
    process CPU with the pool, 63 µs without; the GIL is released either way. Worker processes and
    threads still encode side by side. The library reads the variable at every call."""
    (os.environ if environ is None else environ).setdefault(TOKENIZERS_PARALLELISM, "false")
