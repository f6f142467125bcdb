"""Engine API keys that rotate without a restart (I/O: files, one task owned by the balancer).

Every ``api_key_file`` the config names (pools' and replicas') is watched by one
:class:`KeyWatcher` per worker process: every ``upstream.api_key_poll_s`` it takes each file's
:class:`FileStamp` (the target its symlinks resolve to, device, inode, size, modification time), so a
Kubernetes Secret update (the kubelet swaps the ``..data`` symlink) and a rewrite by rename are both
seen. A changed file is read (off the event loop: a mounted volume may block) and checked as the
loader checks it (:func:`~balancer.config.loader.api_key_text`): a good new key replaces the value of
every :class:`~balancer.config.settings.Secret` read from that file, so every later call (requests,
probes, the ``/v1/models`` check, scrapes, TRT-LLM's drain, on any thread) sends it; a bad one is
refused, logged once (until the file changes or the words of the refusal do) and counted in
``kvlb_upstream_api_key_rejected_total``, and the old key is kept.

An engine that refuses the key (401, 403, 407) calls :meth:`Secret.refused`, which wakes the watcher
to check that file at once instead of at the next poll (at most once a second): a changed stamp is
read as at a poll; an unchanged one is read anyway (the file may have been rewritten within the
stamp's resolution), first a second after the last such read, then with the gap doubling up to a
minute while those reads find no new key (an engine whose key differs from every file costs no
more than that), the gap reset by a rotation.

Keys from ``api_key_env`` are not watched: a process's environment cannot change. The key itself is
never logged: log lines name the file."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from balancer.config.loader import api_key_text, read_api_key_file
from balancer.config.settings import Secret, Settings
from balancer.errors import ConfigError
from balancer.metrics import Metrics

log = logging.getLogger(__name__)

REFUSED_CHECK_GAP_S = 1.0
"""Least time between two checks (a ``stat``) of one key file that engines' refusals ask for (seconds)."""
REFUSED_REREAD_FIRST_GAP_S = 1.0
"""Least time between two reads of an unchanged key file that refusals asked for (seconds)."""
REFUSED_REREAD_MAX_GAP_S = 60.0
"""Longest gap the refusals' re-reads back off to while they find no new key (seconds)."""


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What tells a key file changed without reading it."""

    target: str
    """The path once every symlink is resolved (Kubernetes' ``..data`` swap changes it)."""
    device: int
    inode: int
    size_bytes: int
    mtime_ns: int


def stamp_of(path: str) -> FileStamp:
    """``path``'s stamp (blocking: call it off the event loop); OSError as raised."""
    target = os.path.realpath(path)
    stat = os.stat(path)
    return FileStamp(target, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _look(path: str) -> FileStamp | OSError:
    try:
        return stamp_of(path)
    except OSError as exc:
        return exc


@dataclass(slots=True)
class _KeyFile:
    """One watched file and the secrets read from it."""

    path: str
    secrets: list[Secret]
    stamp: FileStamp | None = None
    """The stamp when the file was last read (``None``: not read by the watcher yet)."""
    refusal: str | None = None
    """The words of the last refusal logged (``None``: the last read was good)."""
    refused_wanted: bool = False
    """An engine refused the key since the last check: check it now."""
    next_check_at: float = 0.0
    """Loop time before which a refusal does not ask for another check."""
    next_reread_at: float = 0.0
    """Loop time before which an unchanged file is not read again for a refusal."""
    reread_gap_s: float = REFUSED_REREAD_FIRST_GAP_S

    @property
    def source(self) -> str:
        return self.secrets[0].source


class KeyWatcher:
    """Re-reads changed engine key files and rotates their secrets (see the module docstring)."""

    def __init__(self, secrets: Iterable[Secret], period_s: float, metrics: Metrics | None = None) -> None:
        """``secrets``: the ones read from files are watched (others ignored); ``period_s``: the poll
        period (0: only refusals trigger a re-read)."""
        self.period_s = period_s
        self._metrics = metrics
        self._files: dict[str, _KeyFile] = {}
        for secret in secrets:
            if secret.file is None:
                continue
            entry = self._files.setdefault(secret.file, _KeyFile(secret.file, []))
            if all(held is not secret for held in entry.secrets):
                entry.secrets.append(secret)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_rotated: Callable[[str], None] | None = None
        """Called on the watcher's loop with a file's path once its new key is in use (the
        balancer lets the breakers that the old key's refusals opened try at once)."""

    @classmethod
    def for_settings(cls, settings: Settings, metrics: Metrics | None = None) -> KeyWatcher | None:
        """The watcher of every key file ``settings`` names (``None``: no key file)."""
        secrets = [
            secret
            for pool in settings.pools
            for secret in (pool.api_key, *(replica.api_key for replica in pool.replicas))
            if secret is not None and secret.file is not None
        ]
        if not secrets:
            return None
        return cls(secrets, settings.upstream.api_key_poll_s, metrics)

    @property
    def files(self) -> list[str]:
        """The watched paths."""
        return list(self._files)

    async def run(self) -> None:
        """Watch until cancelled: a first check at once (a file changed since the loader read it),
        then one every ``period_s`` or when an engine refused a key. The task's owner cancels it."""
        self._loop = asyncio.get_running_loop()
        for entry in self._files.values():
            for secret in entry.secrets:
                secret.on_refused(functools.partial(self._refused_threadsafe, entry.path))
        try:
            await self.check()
            while True:
                try:
                    async with asyncio.timeout(self.period_s or None):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self._wake.clear()
                await self.check()
        finally:
            for entry in self._files.values():
                for secret in entry.secrets:
                    secret.on_refused(None)

    def _refused_threadsafe(self, path: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
            loop.call_soon_threadsafe(self._refused, path)

    def _refused(self, path: str) -> None:
        """On the watcher's loop: an engine refused ``path``'s key; wake the watcher unless a
        re-read for a refusal happened less than the file's current gap ago."""
        entry = self._files.get(path)
        if entry is None or self._loop is None:
            return
        now = self._loop.time()
        if now < entry.next_check_at:
            return
        entry.next_check_at = now + REFUSED_CHECK_GAP_S
        entry.refused_wanted = True
        self._wake.set()

    async def check(self) -> None:
        """Stamp every file, read those that changed (or whose key an engine refused), rotate."""
        entries = list(self._files.values())
        stamps = await asyncio.to_thread(lambda: [_look(entry.path) for entry in entries])
        to_read: list[tuple[_KeyFile, FileStamp]] = []
        now = asyncio.get_running_loop().time()
        for entry, looked in zip(entries, stamps, strict=True):
            forced, entry.refused_wanted = entry.refused_wanted, False
            if isinstance(looked, OSError):
                self._reject(entry, None, "unreadable", f"cannot read {entry.source}: {looked.strerror}")
                continue
            if forced and looked == entry.stamp:  # nothing seen changed: read it, backing off
                if now < entry.next_reread_at:
                    continue
                entry.next_reread_at = now + entry.reread_gap_s
                entry.reread_gap_s = min(entry.reread_gap_s * 2, REFUSED_REREAD_MAX_GAP_S)
            if looked != entry.stamp or forced:
                trigger = "refused" if forced else "changed"
                if entry.stamp is not None and self._metrics is not None:
                    self._metrics.upstream_api_key_rereads_total.labels(trigger).inc()
                to_read.append((entry, looked))
        if not to_read:
            return
        reads = await asyncio.to_thread(lambda: [_read(entry.path) for entry, _ in to_read])
        for (entry, stamp), raw in zip(to_read, reads, strict=True):
            if isinstance(raw, OSError):
                self._reject(entry, stamp, "unreadable", f"cannot read {entry.source}: {raw.strerror}")
                continue
            try:
                key = api_key_text(raw.decode("utf-8", "replace"), "engine key rotation", entry.source)
            except ConfigError as exc:
                self._reject(entry, stamp, "invalid", str(exc))
                continue
            entry.stamp = stamp
            if entry.refusal is not None:
                log.info("engine key file %s is good again", entry.path)
                entry.refusal = None
            if key != entry.secrets[0].value:
                for secret in entry.secrets:
                    secret.rotate(key)
                entry.reread_gap_s = REFUSED_REREAD_FIRST_GAP_S
                entry.next_reread_at = 0.0
                if self._metrics is not None:
                    self._metrics.upstream_api_key_rotations_total.inc()
                log.info("engine key from %s changed: every later call sends the new key", entry.source)
                if self.on_rotated is not None:
                    self.on_rotated(entry.path)

    def _reject(self, entry: _KeyFile, stamp: FileStamp | None, reason: str, words: str) -> None:
        """Keep the old key; log and count once per stamp and words (a poll of an unchanged bad
        file does neither)."""
        if stamp is not None and stamp == entry.stamp and words == entry.refusal:
            return
        if stamp is None and words == entry.refusal:
            return
        entry.stamp = stamp
        entry.refusal = words
        if self._metrics is not None:
            self._metrics.upstream_api_key_rejected_total.labels(reason).inc()
        log.warning("%s: the new key is refused, the old one is kept", words)


def _read(path: str) -> bytes | OSError:
    try:
        return read_api_key_file(path)
    except OSError as exc:
        return exc
