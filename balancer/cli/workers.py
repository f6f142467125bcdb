"""``kvlb serve --workers N``: the supervisor of N worker processes serving one port (I/O).

The supervisor binds the HTTP listening socket itself (``listen.host``/``listen.port``; port 0 picks
one) and hands it to every worker (a pre-forked listener: the kernel queues connections on the one
socket and each worker accepts from it, so a worker that dies loses no queued connection). For gRPC
(``listen.grpc_port``) every worker binds the same port with ``SO_REUSEPORT``; the supervisor reserves
it first (a bound socket that never listens; with port 0 a free one, named to the workers), so a port
another program holds fails the start once, before any worker runs.

Each worker is ``python -m balancer serve`` with the same settings and a :class:`WorkerRole`
(``--worker-index``, ``--listen-fd``, ``--run-dir``, all hidden options). The same settings: the
supervisor writes the very bytes of the settings file it parsed into its run dir at start (never
the file read again: an edit meanwhile would give the workers other settings than its own) and every
worker, a restarted one too, reads that copy, so an edit of the file (a ConfigMap updated under a
running pod) takes effect at the next start of ``kvlb serve``, for all the workers at once, never
for one restarted worker alone. Each worker is a whole balancer with its
own index, fed by its own subscriptions to every ZMQ engine (a PUB fans out to every SUB), so all
workers hold the same index. A TRT-LLM drain is destructive, so worker 0 alone drains each TRT-LLM
engine and republishes every drained body on ``ipc://<run dir>/trtllm-<replica>.ipc``; the other
workers subscribe to it (:mod:`balancer.sources.trtllm_relay`).

The supervisor also creates the shared-memory table in which each worker publishes its per-replica
load for the others (:class:`balancer.load.share.LoadTable`, named to the workers with
``--load-table``; ``limits.load_share_slots`` slots per worker), zeroes a worker's row as soon as that
worker exits (its requests went with it) and removes the table when it stops.

The supervisor prints ``{"kvlb": "serving", "url": ..., "workers": N}`` once every worker announced
itself (a worker that exits before it announced itself fails the start: :class:`WorkerStartError`, as
a settings error that only a worker finds, e.g. a ``listen.grpc_port`` in use, would fail every
restart too), restarts a worker that exits (the settings' ``workers`` section,
:class:`~balancer.config.WorkersConfig`: after ``restart_backoff_s``, doubling with each exit of
that worker within ``restart_window_s`` up to ``max_restart_backoff_s``,
:mod:`balancer.worker_restarts`; each restart is logged, and the worker's count is passed to the new
process, which exports it as ``kvlb_process_restarts_total``),
and keeps each worker's restarts, failed starts (exits before it announced itself) and newest exit
times in its record (:mod:`balancer.worker_record`), which the workers that serve read for
``/metrics`` and ``/readyz``. A worker that exited ``crash_loop_exits`` times within the window
(serving in between or not), or as many times in a row before serving, is in a crash loop: logged
as an error at each restart while the others serve; once every worker is, the supervisor gives up
and ``kvlb serve`` exits non-zero (:class:`WorkerStartError`), so the orchestrator restarts the pod
and shows the loop (Kubernetes' CrashLoopBackOff). On SIGTERM/SIGINT it forwards the signal to every
worker, closes its own copy of the listening socket (so that, once the workers have closed theirs,
a new connection is refused instead of waiting in the kernel's queue for a worker that will never
accept it) and waits for them (each drains its in-flight requests within ``--shutdown-grace-s``;
one still alive ``kill_after_s`` later is killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from balancer import strict_json
from balancer.cli.early_signals import NO_RELOAD
from balancer.config import Settings, SettingsSource, WorkersConfig
from balancer.errors import BalancerError, bind_error
from balancer.load.share import LoadTable
from balancer.worker_record import WorkerRecord, write_record
from balancer.worker_restarts import crash_looping, exits_kept, recent_exits, restart_delay_s

log = logging.getLogger(__name__)


class WorkerStartError(BalancerError):
    """The workers did not all start: one exited before it announced itself, or they took longer than
    ``start_timeout_s``; or, later, every worker was in a crash loop (``workers.crash_loop_exits``).
    ``kvlb serve`` stops the others and exits with :attr:`exit_status` and this message."""

    def __init__(self, message: str, exit_status: int = 1, *, others_stopped: bool = True) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        """2 when the worker refused its settings (it exited 2, as ``kvlb serve`` does), else 1."""
        self.others_stopped = others_stopped
        """Whether other workers were running, and were stopped (not so once every worker gave up)."""


@dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    failed_starts: int = 0
    """Exits in a row before it announced itself (0 once it serves)."""
    last_exit: int = 0
    backoff_s: float = 0.0
    exit_times: deque[float] = field(default_factory=deque)
    """Its newest exits (``time.monotonic()``), at most :func:`~balancer.worker_restarts.exits_kept`."""
    url: str = ""
    reader: asyncio.Task[None] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, inheritable by the workers; a
    :class:`~balancer.errors.ConfigError` naming ``listen.port`` when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except (OSError, OverflowError) as exc:  # a port in use, a host that resolves to nothing
        sock.close()
        raise bind_error("listen.port", host, port, exc) from None
    sock.set_inheritable(True)
    return sock


def reserved_port(host: str, port: int = 0) -> socket.socket:
    """A bound, never-listening ``SO_REUSEPORT`` socket on ``port`` (0: a free one): keeps the port
    while the workers bind it with ``SO_REUSEPORT`` too. A port another program holds is a
    :class:`~balancer.errors.ConfigError` naming ``listen.grpc_port``, found here once rather than by
    every worker. ``SO_REUSEADDR`` as well, as gRPC's own sockets and the HTTP listener have: the
    connections a stopped kvlb closed linger in TIME_WAIT on the port for a minute, and without it
    a restart in the same network namespace (a container restarted in its pod) could not bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        raise bind_error("listen.grpc_port", host, port, exc) from None
    return sock


SETTINGS_COPY = "settings.yaml"
"""The run dir's copy of the settings file the supervisor started with: what every worker reads."""


def write_settings_copy(run_dir: str, source: SettingsSource) -> str:
    """Write the bytes the supervisor parsed (``source.data``, not the file as it is now) to
    :data:`SETTINGS_COPY` in ``run_dir`` (owner-only: it may name key files) and return its path;
    :class:`WorkerStartError` when it cannot be written (a full disk)."""
    copy = os.path.join(run_dir, SETTINGS_COPY)
    try:
        descriptor = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(descriptor, "wb") as file:
            file.write(source.data)
    except OSError as exc:
        raise WorkerStartError(
            f"cannot write the workers' copy of {source.path} in {run_dir}: {exc}"
        ) from None
    return copy


SETTINGS_ERROR_MARK = "settings-error"
"""A file in the run dir: the first worker to fail on a settings error creates it and prints the
error; the others, which load the same settings and fail the same way, exit without printing it."""


def first_to_report(run_dir: str) -> bool:
    """Whether this worker is the first among those started together to report a settings error (it
    then creates :data:`SETTINGS_ERROR_MARK`); ``True`` as well when the mark cannot be made, so that
    an error is never lost."""
    try:
        os.close(
            os.open(os.path.join(run_dir, SETTINGS_ERROR_MARK), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        )
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


class Supervisor:
    """Starts ``count`` workers on one listening socket, restarts the ones that exit, stops them all."""

    def __init__(
        self,
        settings: Settings,
        count: int,
        worker_argv: Sequence[str],
        *,
        supervisor: WorkersConfig | None = None,
        shutdown_grace_s: float = 30.0,
        config_source: SettingsSource | None = None,
    ) -> None:
        """``worker_argv`` is ``kvlb serve``'s own options but the settings file (``--set``, log
        level, grace); ``config_source`` the settings file ``settings`` were parsed from, if any, with
        the bytes parsed; ``supervisor`` replaces ``settings.workers`` (tests)."""
        self.settings = settings
        self.config_source = config_source
        self._config_copy: str | None = None
        """The run dir's copy of :attr:`config_source`'s bytes, which the workers read."""
        self.count = count
        self.worker_argv = list(worker_argv)
        self.config = supervisor or settings.workers
        self.shutdown_grace_s = shutdown_grace_s
        kept = exits_kept(self.config)
        self.workers = [_Worker(i, exit_times=deque(maxlen=kept)) for i in range(count)]
        self.url = ""
        self.grpc_port: int | None = None
        self.run_dir = ""
        self._sock: socket.socket | None = None
        self._grpc_sock: socket.socket | None = None
        self.load_table: LoadTable | None = None
        """The workers' shared per-replica load (created at :meth:`start`)."""
        self._stopping = False
        self._restarters: set[asyncio.Task[None]] = set()
        self._serving = False
        """Every worker announced itself once: from then on a worker that exits is restarted."""
        self._start_failed = asyncio.Event()
        self.start_failure = ""
        """Why :meth:`start` failed: the first worker that exited before it announced itself."""
        self._start_failure_status = 1
        self.gave_up = asyncio.Event()
        """Set when every worker is in a crash loop: :attr:`give_up_reason` says why."""
        self.give_up_reason = ""

    def _record(self) -> None:
        """Rewrite the workers' record (restarts, failed starts) in the run dir."""
        record = WorkerRecord(
            tuple(w.restarts for w in self.workers),
            tuple(w.failed_starts for w in self.workers),
            self.config.crash_loop_exits,
            tuple(tuple(w.exit_times) for w in self.workers),
            self.config.restart_window_s,
        )
        try:
            write_record(self.run_dir, record)
        except OSError as exc:  # the run dir is ours: only a full disk gets here
            log.warning("the workers' record was not written (%s)", exc)

    def give_up_error(self) -> WorkerStartError:
        """What ``kvlb serve`` exits with once :attr:`gave_up` is set: 2 when every worker's last exit
        was a settings error (exit 2), else 1."""
        status = 2 if all(w.last_exit == 2 for w in self.workers) else 1
        return WorkerStartError(self.give_up_reason, status, others_stopped=False)

    async def start(self) -> None:
        listen = self.settings.listen
        self.run_dir = tempfile.mkdtemp(prefix="kvlb-workers-")
        if self.config_source is not None:  # every worker, a restarted one too, reads the start's settings
            self._config_copy = write_settings_copy(self.run_dir, self.config_source)
        limits = self.settings.limits
        self.load_table = LoadTable(self.count, limits.load_share_slots, limits.load_share_tenant_slots)
        self._sock = listening_socket(listen.host, listen.port)
        host, port = self._sock.getsockname()[:2]
        scheme = "https" if listen.tls_cert_file is not None else "http"
        self.url = f"{scheme}://{host}:{port}"
        if listen.grpc_port is not None:
            self._grpc_sock = reserved_port(listen.host, listen.grpc_port)
            self.grpc_port = int(self._grpc_sock.getsockname()[1])
        self._record()
        await asyncio.gather(*(self._spawn(worker) for worker in self.workers))
        ready = asyncio.ensure_future(asyncio.gather(*(worker.ready.wait() for worker in self.workers)))
        failed = asyncio.ensure_future(self._start_failed.wait())
        try:
            done, _ = await asyncio.wait(
                (ready, failed), timeout=self.config.start_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in (ready, failed):
                waiter.cancel()
            await asyncio.gather(ready, failed, return_exceptions=True)
        if ready not in done:
            raise WorkerStartError(
                self.start_failure
                or f"the workers did not announce themselves within {self.config.start_timeout_s:g} s",
                self._start_failure_status,
            )
        self._serving = True

    def _argv(self, worker: _Worker) -> list[str]:
        assert self._sock is not None
        argv = [sys.executable, "-m", "balancer", "serve", *self.worker_argv]
        if self._config_copy is not None:
            argv += ["--config", self._config_copy]
        argv += ["--workers", str(self.count), "--worker-index", str(worker.index)]
        argv += ["--listen-fd", str(self._sock.fileno()), "--run-dir", self.run_dir]
        argv += ["--worker-restarts", str(worker.restarts)]
        argv += ["--supervisor-pid", str(os.getpid())]
        if self.load_table is not None:
            argv += ["--load-table", self.load_table.name]
        if self.grpc_port is not None:
            argv += ["--set", f"listen.grpc_port={self.grpc_port}"]
        return argv

    async def _spawn(self, worker: _Worker) -> None:
        assert self._sock is not None
        worker.ready = asyncio.Event()
        process = await asyncio.create_subprocess_exec(
            *self._argv(worker), stdout=asyncio.subprocess.PIPE, pass_fds=(self._sock.fileno(),)
        )
        worker.process = process
        worker.started_at = time.monotonic()
        worker.reader = asyncio.create_task(self._follow(worker, process), name=f"kvlb-worker-{worker.index}")

    async def _follow(self, worker: _Worker, process: asyncio.subprocess.Process) -> None:
        """Read the worker's stdout (its announcement), wait for its exit, restart it unless stopping."""
        assert process.stdout is not None
        while line := await process.stdout.readline():
            text = line.decode(errors="replace").strip()
            if text.startswith("{") and '"kvlb"' in text:
                with contextlib.suppress(ValueError):
                    worker.url = str(json.loads(text).get("url", ""))
                worker.ready.set()
                if worker.failed_starts:
                    worker.failed_starts = 0
                    self._record()
        code = await process.wait()
        if self.load_table is not None:
            self.load_table.zero_row(worker.index)  # its requests died with it
        if self._stopping:
            return
        now = time.monotonic()
        ran_s = now - worker.started_at
        worker.last_exit = code
        if not self._serving:  # a worker that cannot start (its error is on stderr) would again
            if not self.start_failure:
                self._start_failure_status = 2 if code == 2 else 1
                self.start_failure = (
                    f"worker {worker.index} exited with {code} after {ran_s:.1f}s, while the workers started"
                    + (" (its settings error is above)" if code == 2 else "")
                )
            self._start_failed.set()
            return
        worker.exit_times.append(now)
        recent = recent_exits(worker.exit_times, now, self.config.restart_window_s)
        worker.backoff_s = restart_delay_s(recent, self.config)
        worker.restarts += 1
        if not worker.ready.is_set():
            worker.failed_starts += 1
        self._record()
        looping = crash_looping(recent, worker.failed_starts, self.config)
        if all(self._crash_looping(w, now) for w in self.workers):
            self.give_up_reason = self._give_up_reason(worker, code, ran_s, now)
            log.error("%s", self.give_up_reason)
            self.gave_up.set()
            return
        log.log(
            logging.ERROR if looping else logging.WARNING,
            "worker %d (pid %d) exited with %d after %.1fs%s; restarting in %.1fs (restart %d)",
            worker.index,
            process.pid,
            code,
            ran_s,
            f", {self._loop_words(worker, now)}: a crash loop" if looping else "",
            worker.backoff_s,
            worker.restarts,
        )
        await asyncio.sleep(worker.backoff_s)
        if not self._stopping:
            with contextlib.suppress(OSError):  # a restart that fails reports its own error
                os.remove(os.path.join(self.run_dir, SETTINGS_ERROR_MARK))
            await self._spawn(worker)

    def _crash_looping(self, worker: _Worker, now: float) -> bool:
        recent = recent_exits(worker.exit_times, now, self.config.restart_window_s)
        return crash_looping(recent, worker.failed_starts, self.config)

    def _loop_words(self, worker: _Worker, now: float) -> str:
        """How ``worker`` is in its crash loop: its failed starts in a row, else its recent exits."""
        if worker.failed_starts >= self.config.crash_loop_exits:
            return f"{worker.failed_starts} times in a row before serving"
        recent = recent_exits(worker.exit_times, now, self.config.restart_window_s)
        return f"{recent} exits in the last {self.config.restart_window_s:g} s"

    def _give_up_reason(self, worker: _Worker, code: int, ran_s: float, now: float) -> str:
        limit = self.config.crash_loop_exits
        last = f"worker {worker.index} last exited with {code} after {ran_s:.1f}s"
        if all(w.failed_starts >= limit for w in self.workers):
            times = f"{limit} time{'s' if limit > 1 else ''}"
            return (
                f"every worker exited {times} in a row before serving ({last}; its error is above): giving up"
            )
        loops = "; ".join(f"worker {w.index}: {self._loop_words(w, now)}" for w in self.workers)
        return f"every worker is in a crash loop ({loops}; {last}): giving up"

    def pids(self) -> list[int]:
        """The live workers' process ids, by index (0 for one being restarted)."""
        return [
            w.process.pid if w.process is not None and w.process.returncode is None else 0
            for w in self.workers
        ]

    async def stop(self) -> None:
        """SIGTERM every worker, wait for them (killing laggards), close the sockets, remove the run dir."""
        self._stopping = True
        live = [w.process for w in self.workers if w.process is not None and w.process.returncode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        if self._sock is not None:  # the workers close their copies as they drain: once all are
            self._sock.close()  # closed a new connection is refused, rather than queued unanswered
            self._sock = None
        for process in live:
            try:
                async with asyncio.timeout(self.shutdown_grace_s + self.config.kill_after_s):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        readers = [w.reader for w in self.workers if w.reader is not None]
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for sock in (self._sock, self._grpc_sock):
            if sock is not None:
                sock.close()
        self._sock = self._grpc_sock = None
        if self.load_table is not None:
            self.load_table.close()
            self.load_table = None
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


async def supervise(
    settings: Settings,
    count: int,
    worker_argv: Sequence[str],
    shutdown_grace_s: float,
    config_source: SettingsSource | None = None,
) -> None:
    """Run ``count`` workers until SIGTERM/SIGINT, printing the serving line once all are up. A signal
    while they start stops them; a failed start raises :class:`WorkerStartError` (or
    :class:`~balancer.errors.ConfigError` for a port it cannot bind) once they are stopped; a
    ``redis.url`` database the server does not have is a ``ConfigError`` before any worker starts."""
    if settings.redis.url is not None:
        from balancer.fleet.redis_checks import check_database

        await check_database(settings.redis)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, log.warning, NO_RELOAD)  # the workers ignore theirs too
    supervisor = Supervisor(
        settings, count, worker_argv, shutdown_grace_s=shutdown_grace_s, config_source=config_source
    )
    try:
        starting = asyncio.create_task(supervisor.start(), name="kvlb-workers-start")
        signalled = asyncio.create_task(stop.wait(), name="kvlb-workers-start-signal")
        try:
            await asyncio.wait((starting, signalled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (starting, signalled):
                if not task.done():
                    task.cancel()
            await asyncio.gather(starting, signalled, return_exceptions=True)
        if stop.is_set():  # the workers got the signal too: their exits are no failed start
            log.info("signal received while the workers started: stopping them")
            return
        starting.result()  # raises why the start failed
        announcement = {
            "kvlb": "serving",
            "url": supervisor.url,
            "workers": count,
            "pid": os.getpid(),
            "worker_pids": supervisor.pids(),
        }
        print(strict_json.dumps(announcement), flush=True)
        signalled = asyncio.create_task(stop.wait(), name="kvlb-workers-signal")
        gave_up = asyncio.create_task(supervisor.gave_up.wait(), name="kvlb-workers-gave-up")
        try:
            await asyncio.wait((signalled, gave_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (signalled, gave_up):
                task.cancel()
            await asyncio.gather(signalled, gave_up, return_exceptions=True)
        if not stop.is_set() and supervisor.gave_up.is_set():
            raise supervisor.give_up_error()
        log.info("signal received: stopping %d workers", count)
    finally:
        await supervisor.stop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
