"""``kvlb serve`` (run the balancer) and ``kvlb admin`` (talk to a running one's admin API) (I/O).

``kvlb serve`` prints one JSON line ``{"kvlb": "serving", "url": ...}`` on stdout once it listens
(useful with ``--set listen.port=0``), logs to stderr, and shuts down in order on SIGTERM or SIGINT.
``kvlb admin`` prints the server's JSON answer on stdout; an error answer goes to stderr, exit 1.

The service itself (:mod:`balancer.app`, the workers' supervisor) is imported only once ``kvlb serve``
runs as it will: the first process reads the settings and, for ``allocator: auto`` with jemalloc
installed, replaces itself at once (``os.execve``) without paying the service's imports twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import math
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from balancer import strict_json
from balancer.cli.early_signals import NO_RELOAD, exec_keeping_signals
from balancer.config import Settings, allocator_environ, load_with_source, one_thread_per_encode
from balancer.config.bounds import LOG_LEVELS
from balancer.errors import ConfigError
from balancer.serve_options import ServeOptions, WorkerRole

log = logging.getLogger(__name__)

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def register(subparsers: SubParsers) -> None:
    _register_serve(subparsers)
    _register_admin(subparsers)


# ------------------------------------------------------------------------------------------ serve


def _register_serve(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the balancer",
        description="Serve the OpenAI-compatible endpoint in front of the configured replicas. Settings "
        "come from the YAML file, then KVLB_* environment variables (KVLB_LIMITS__MAX_INFLIGHT=64), "
        "then --set; see docs/http-api.md.",
    )
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML settings file (default: $KVLB_CONFIG)")
    parser.add_argument(
        "--set",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        help="override one setting, e.g. --set listen.port=9000 --set policy.name=least_load (repeatable)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=ServeOptions().shutdown_grace_s,
        help="after SIGTERM, seconds in-flight requests get to finish (default %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default=None,
        help="logging level: debug, info, warning, error or critical (default: the log_level setting)",
    )
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="worker processes serving the port (default: the cores this process may use, capped by its "
        "cgroup's CPU limit: %(default)s); 1 serves in this process",
    )
    # Set by the supervisor of --workers N for each worker it starts (docs/architecture.md).
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load-table", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-restarts", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--supervisor-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(handler=run_serve)


CGROUP_ROOT = Path("/sys/fs/cgroup")


def default_workers(cgroup_root: Path = CGROUP_ROOT) -> int:
    """``--workers`` by default: the cores this process may run on, capped by its cgroup's CPU limit
    rounded up (a container's ``--cpus`` or ``limits.cpu``, which the affinity mask does not show: a
    pod limited to 2 CPUs on a 64-core node would otherwise start 64 workers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)


def cgroup_cpu_limit(root: Path) -> float | None:
    """The CPU limit in cores of the cgroup mounted at ``root`` (v2 ``cpu.max``, else v1
    ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); ``None`` when there is none or it cannot be
    read."""
    try:
        quota, _, period = (root / "cpu.max").read_text().partition(" ")
    except OSError:
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        quota_us, period_us = float(quota), float(period)
    except ValueError:  # "max": no limit
        return None
    if quota_us <= 0 or period_us <= 0:  # v1 says -1 for no limit
        return None
    return quota_us / period_us


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``kvlb serve`` options a worker gets from its supervisor (all but the worker ones and the
    settings file: the supervisor gives its copy)."""
    argv: list[str] = []
    for item in args.set:
        argv += ["--set", item]
    argv += ["--shutdown-grace-s", str(args.shutdown_grace_s)]
    if args.log_level:
        argv += ["--log-level", args.log_level]
    if args.no_uvloop:
        argv.append("--no-uvloop")
    return argv


def jemalloc_loaded() -> bool:
    """Whether jemalloc is this process's allocator (it exports ``mallctl``; the C library does not)."""
    return hasattr(ctypes.CDLL(None), "mallctl")


def log_allocator(settings: Settings, on_jemalloc: bool) -> None:
    """Say once at start which allocator ``kvlb serve`` runs on (a warning when ``allocator: jemalloc``
    could not be had)."""
    if on_jemalloc:
        log.info(
            "allocator: jemalloc (%s preloaded; allocator: %s)", settings.jemalloc_library, settings.allocator
        )
    elif settings.allocator == "jemalloc":
        log.warning("allocator: system (allocator: jemalloc, but %s not found)", settings.jemalloc_library)
    elif settings.allocator == "auto":
        log.info("allocator: system (allocator: auto; %s not found)", settings.jemalloc_library)
    else:
        log.info("allocator: system (allocator: system)")


def settings_memfd(data: bytes) -> int:
    """An inheritable in-memory file holding ``data``, at offset 0: the settings file's bytes as this
    image read them, for the image ``kvlb serve`` re-executes itself as (``--settings-fd``)."""
    descriptor = os.memfd_create("kvlb-settings", 0)
    with open(descriptor, "wb", closefd=False) as file:
        file.write(data)
    os.lseek(descriptor, 0, os.SEEK_SET)
    os.set_inheritable(descriptor, True)
    return descriptor


def read_settings_fd(descriptor: int | None) -> bytes | None:
    """The bytes of ``--settings-fd`` (closed once read); ``None`` without it."""
    if descriptor is None:
        return None
    try:
        with open(descriptor, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the settings handed over on fd {descriptor}: {exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    try:
        given = read_settings_fd(args.settings_fd)
        settings, source = load_with_source(args.config, args.set, data=given)
    except ConfigError as exc:
        print(f"kvlb serve: {exc}", file=sys.stderr)
        return 2
    reexec = allocator_environ(settings)
    if reexec is not None:  # before anything else: the process image is replaced
        sys.stdout.flush()
        sys.stderr.flush()  # SIGTERM and SIGINT stay blocked until the new image handles them
        argv = [sys.executable, "-m", "balancer", *sys.argv[1:]]
        if source is not None:  # the new image parses the same bytes: the file is not read again
            argv += ["--settings-fd", str(settings_memfd(source.data))]
        exec_keeping_signals(sys.executable, argv, reexec)
    level = (args.log_level or settings.log_level).upper()
    if level not in LOG_LEVELS:
        choices = ", ".join(LOG_LEVELS)
        print(f"kvlb serve: --log-level must be one of {choices}, got {level.lower()!r}", file=sys.stderr)
        return 2
    one_thread_per_encode()
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.worker_index is None:  # once per server: its workers inherit the allocator
        log_allocator(settings, jemalloc_loaded())
    if args.shutdown_grace_s < 0:
        print("kvlb serve: --shutdown-grace-s must be >= 0", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("kvlb serve: --workers must be >= 1", file=sys.stderr)
        return 2
    role = None
    if args.worker_index is not None:
        if args.listen_fd is None or args.run_dir is None:
            print("kvlb serve: --worker-index needs --listen-fd and --run-dir", file=sys.stderr)
            return 2
        role = WorkerRole(
            args.worker_index,
            args.workers,
            args.listen_fd,
            args.run_dir,
            args.load_table,
            restarts=max(0, args.worker_restarts),
            supervisor_pid=args.supervisor_pid,
        )
        _die_with_parent()
        if args.supervisor_pid is not None and os.getppid() != args.supervisor_pid:
            # the supervisor died before the kernel was asked to kill this worker with it
            print(f"kvlb serve: the supervisor (pid {args.supervisor_pid}) is gone; exiting", file=sys.stderr)
            return 1
    elif args.workers > 1:
        from balancer.cli.workers import WorkerStartError, supervise

        supervise_run = supervise(settings, args.workers, worker_argv(args), args.shutdown_grace_s, source)
        try:
            _runner(not args.no_uvloop)(supervise_run)
        except ConfigError as exc:
            print(f"kvlb serve: {exc}", file=sys.stderr)
            return 2
        except WorkerStartError as exc:
            stopped = "; the other workers were stopped" if exc.others_stopped else ""
            print(f"kvlb serve: {exc}{stopped}", file=sys.stderr)
            return exc.exit_status
        return 0
    options = ServeOptions(shutdown_grace_s=args.shutdown_grace_s, worker=role)
    try:
        _runner(not args.no_uvloop)(serve(settings, options))
    except ConfigError as exc:
        from balancer.cli.workers import first_to_report

        if role is None or first_to_report(role.run_dir):  # once, not once per worker
            print(f"kvlb serve: {exc}", file=sys.stderr)
        return 2
    return 0


async def serve(settings: Settings, options: ServeOptions) -> None:
    """Run until SIGTERM/SIGINT, then stop in order (a second signal is ignored: shutdown is bounded
    by ``shutdown_grace_s``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the service's imports (a second or so)
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, log.warning, NO_RELOAD)
    if settings.redis.url is not None:  # before the service's imports and tokenizers (seconds)
        from balancer.fleet.redis_checks import check_database

        await check_database(settings.redis)
    from balancer.app import Balancer
    from balancer.gc_tuning import settle_after_start

    balancer = Balancer(settings, options=options)
    orphan_watch = None
    if options.worker is not None:  # a worker ends with its supervisor, even one killed with -9
        parent = options.worker.supervisor_pid or os.getppid()
        orphan_watch = asyncio.create_task(_stop_when_orphaned(parent, stop), name="kvlb-orphan-watch")
    try:
        await balancer.start()
        settle_after_start()
        print(strict_json.dumps({"kvlb": "serving", "url": balancer.url}), flush=True)
        await stop.wait()
        log.info("signal received: draining for up to %.1fs, then stopping", options.shutdown_grace_s)
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
        await balancer.stop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    log.info("stopped")


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel sends this worker SIGKILL when its supervisor dies (even by SIGKILL), so no
    orphan keeps the listener; elsewhere :func:`_stop_when_orphaned` notices within a second. A
    supervisor that died before this call is found right after it: the worker's parent is no longer
    the ``--supervisor-pid`` it was given, and it exits 1 before it serves."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


ORPHAN_CHECK_S = 1.0
"""How often (seconds) a worker checks that its supervisor is still its parent."""


async def _stop_when_orphaned(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:  # noqa: ASYNC110 (no event tells a process its parent died)
        await asyncio.sleep(ORPHAN_CHECK_S)
    log.warning("the supervisor (pid %d) is gone: stopping", parent_pid)
    stop.set()


def _runner(use_uvloop: bool) -> Callable[[Coroutine[Any, Any, None]], None]:
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.run
    return asyncio.run


# ------------------------------------------------------------------------------------------ admin


def _register_admin(subparsers: SubParsers) -> None:
    parser = subparsers.add_parser(
        "admin",
        help="inspect and tune a running balancer",
        description="Call a running balancer's admin API and print its JSON answer.",
    )
    _connection_options(parser)
    # the same options after the action too (``kvlb admin decisions --url ...``): no defaults there,
    # so that one given before the action is kept
    connection = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _connection_options(connection, defaults=False)
    actions = parser.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    policy = actions.add_parser("policy", help="show or change the routing policy", parents=[connection])
    policy_actions = policy.add_subparsers(dest="policy_command", metavar="get|set", required=True)
    policy_actions.add_parser("get", help="print the policy in force", parents=[connection])
    setter = policy_actions.add_parser(
        "set", help="change it: name=cost overlap_credit=0.5 ...", parents=[connection]
    )
    setter.add_argument("pairs", nargs="+", metavar="NAME=VALUE", help="'name' or a weight (null clears)")
    setter.add_argument("--reason", help="why, for the audit log (at most 500 characters)")
    setter.add_argument("--actor", help="who, for the audit log (x-kvlb-actor; default: admin)")
    whatif = actions.add_parser(
        "whatif",
        parents=[connection],
        help="replay recent decisions with other weights or another policy (commits nothing)",
        description="Re-run the policy on the pool's recorded decisions with proposed weights and print "
        "what would change: share of changed decisions, predicted hit rate, load spread, replicas.",
    )
    whatif.add_argument(
        "--weight",
        "-w",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a proposed weight (repeatable)",
    )
    whatif.add_argument("--policy", help="policy to replay (default: the one in force)")
    whatif.add_argument("--pool", help="model name of the pool (default: the only pool)")
    whatif.add_argument("--last", type=int, help="replay only the newest N decisions")
    whatif.add_argument("--sample", type=int, help="changed decisions to describe (0..100, default 10)")
    whatif.add_argument("--json", action="store_true", help="print the JSON answer, not a table")
    decisions = actions.add_parser(
        "decisions", help="recent routing decisions, newest first", parents=[connection]
    )
    decisions.add_argument("--pool", help="only this pool (model name)")
    decisions.add_argument("--replica", help="only decisions for this replica")
    decisions.add_argument("--tenant", help="only this tenant header value")
    decisions.add_argument("--since-id", metavar="CURSOR",
        help="only decisions after this id; with `kvlb serve --workers N`, pass the cursor printed "
        "after the table (one id per worker, comma-separated) so that no worker's are skipped")  # fmt: skip
    decisions.add_argument("--limit", type=int, help="at most N (1..1000, default 100)")
    decisions.add_argument("--id", type=int, help="one decision with its full explanation")
    decisions.add_argument("--json", action="store_true", help="print the JSON answer, not a table")
    audit = actions.add_parser(
        "audit", help="policy changes: who, when, what, why (newest first)", parents=[connection]
    )
    audit.add_argument("--limit", type=int, help="at most N (1..1000, default 100)")
    audit.add_argument("--json", action="store_true", help="print the JSON answer, not a table")
    explain = actions.add_parser("explain", help="dry-run routing of a request body", parents=[connection])
    explain.add_argument("file", help="JSON request body file ('-' for stdin)")
    replicas = actions.add_parser(
        "replicas", help="health, load, index, prediction and events per replica", parents=[connection]
    )
    replicas.add_argument(
        "--table",
        action="store_true",
        help="one line per replica (routable, in flight, index blocks, prediction accuracy, event lag, "
        "last resync) instead of the JSON",
    )
    for name in ("drain", "undrain"):
        action = actions.add_parser(name, help=f"{name} a replica", parents=[connection])
        action.add_argument("replica", help="replica id")
        action.add_argument("--reason", help="why, shown with the drain (at most 500 characters)")
        action.add_argument("--actor", help="who, shown with the drain (x-kvlb-actor; default: admin)")
    parser.set_defaults(handler=run_admin)


def _connection_options(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """``kvlb admin``'s options of the call itself. ``defaults=False``: none set when not given (the
    copies after the action, which must keep one given before it)."""
    url, timeout_s = ("http://127.0.0.1:8000", 10.0) if defaults else (argparse.SUPPRESS, argparse.SUPPRESS)
    parser.add_argument("--url", default=url, help="balancer URL (default http://127.0.0.1:8000)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", help="admin bearer token (auth.admin_token)")
    token.add_argument("--token-file", type=Path, help="file holding the admin token (keeps it out of ps)")
    parser.add_argument(
        "--timeout-s", type=float, default=timeout_s, help="HTTP timeout, seconds (default 10)"
    )


def admin_request(args: argparse.Namespace) -> tuple[str, str, Any]:
    """(method, path, JSON body or None) for the parsed ``kvlb admin`` arguments."""
    command = args.admin_command
    if command == "policy" and args.policy_command == "get":
        return "GET", "/admin/policy", None
    if command == "policy":
        body: dict[str, Any] = {}
        weights: dict[str, Any] = {}
        for item in args.pairs:
            name, sep, raw = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"expected NAME=VALUE, got {item!r}")
            if name.strip() == "name":
                body["name"] = raw.strip()
            else:
                weights[name.strip()] = yaml.safe_load(raw) if raw.strip() else None
        if weights:
            body["weights"] = weights
        if args.reason is not None:
            body["reason"] = args.reason
        return "PUT", "/admin/policy", body
    if command == "whatif":
        proposed: dict[str, Any] = {}
        for item in args.weight:
            name, sep, raw = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"expected NAME=VALUE, got {item!r}")
            proposed[name.strip()] = yaml.safe_load(raw) if raw.strip() else None
        body = {"weights": proposed or None, "policy": args.policy, "pool": args.pool}
        body.update({"last": args.last, "sample": args.sample})
        return "POST", "/admin/whatif", body
    if command == "decisions":
        if args.id is not None:
            return "GET", f"/admin/decisions/{args.id}", None
        params = {
            "pool": args.pool,
            "replica": args.replica,
            "tenant": args.tenant,
            "since_id": args.since_id,
            "limit": args.limit,
        }
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        return "GET", "/admin/decisions" + (f"?{query}" if query else ""), None
    if command == "audit":
        return "GET", "/admin/audit" + ("" if args.limit is None else f"?limit={args.limit}"), None
    if command == "explain":
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
        return "POST", "/admin/explain", json.loads(text)
    if command == "replicas":
        return "GET", "/admin/replicas", None
    reason = getattr(args, "reason", None)
    return (
        "POST",
        f"/admin/replicas/{urllib.parse.quote(args.replica, safe='')}/{command}",
        None if reason is None else {"reason": reason},
    )


def run_admin(args: argparse.Namespace) -> int:
    try:
        if args.token is not None and args.token_file is not None:
            raise ValueError("give --token or --token-file, not both")
        method, path, body = admin_request(args)
        token = args.token_file.read_text("utf-8").strip() if args.token_file else args.token
        data = None if body is None else json.dumps(body, allow_nan=False).encode("utf-8")  # strict JSON
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"kvlb admin: {exc}", file=sys.stderr)
        return 2
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if getattr(args, "actor", None):
        headers["x-kvlb-actor"] = args.actor
    url = args.url.rstrip("/")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https") or args.timeout_s <= 0:
        print(
            f"kvlb admin: need an http(s):// --url and --timeout-s > 0, got {url!r} and {args.timeout_s:g}",
            file=sys.stderr,
        )
        return 2
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        print(f"kvlb admin: HTTP {exc.code}: {exc.read().decode('utf-8', 'replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        print(f"kvlb admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    table = None if getattr(args, "json", True) else TABLES.get(args.admin_command)
    if getattr(args, "table", False) and isinstance(answer, dict):
        print(replicas_table(answer.get("replicas", []), answer.get("kept_drains") or []))
    elif table is not None and not (args.admin_command == "decisions" and args.id is not None):
        print(table(answer))
    else:
        print(strict_json.dumps(answer, indent=2))
    return 0


REPLICAS_COLUMNS = (
    "replica",
    "routable",
    "inflight",
    "blocks",
    "receipts",
    "exact",
    "within_1",
    "lag_s",
    "resync_age_s",
    "events",
)
"""The columns of ``kvlb admin replicas --table``."""


def replicas_table(views: list[dict[str, Any]], kept_drains: list[dict[str, Any]] | None = None) -> str:
    """``/admin/replicas`` as one line per replica: whether it takes traffic (and why not), the
    prediction accuracy over its last receipts (exact share, share within one block), its event lag,
    the age of its last resync and the state of its event streams (:func:`events_cell`); then one
    line per drained replica, per drain kept for a removed replica (:func:`kept_drain_line`), per
    replica whose engine serves another model (with the fix) and per event source with a problem
    (:func:`event_problems`)."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    rows: list[tuple[str, ...]] = [REPLICAS_COLUMNS]
    for view in views:
        prediction = view.get("prediction") or {}
        events = view.get("events") or {}
        rows.append(
            tuple(
                cell(v)
                for v in (
                    view.get("id"),
                    routable_cell(view),
                    view.get("inflight"),
                    (view.get("index") or {}).get("blocks"),
                    prediction.get("receipts"),
                    prediction.get("accuracy"),
                    prediction.get("within_one_block"),
                    events.get("last_lag_s"),
                    events.get("last_resync_age_s"),
                    events_cell(view),
                )
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(REPLICAS_COLUMNS))]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    drained = [_drained_line(view) for view in views if (view.get("health") or {}).get("drain")]
    wrong_model = [
        f"{view.get('id')}: {view['health']['model_mismatch']}"
        for view in views
        if (view.get("health") or {}).get("model_mismatch")
    ]
    key_refused = [
        f"{view.get('id')}: {view['health']['key_refused']}"
        for view in views
        if (view.get("health") or {}).get("key_refused")
    ]
    kept = [kept_drain_line(entry) for entry in kept_drains or ()]
    return "\n".join(table + drained + kept + key_refused + wrong_model + event_problems(views))


def kept_drain_line(kept: dict[str, Any]) -> str:
    """``<replica> (removed): <the kept text>; forgotten in <s> s unless added again``."""
    left = kept.get("expires_in_s")
    when = (
        ""
        if not isinstance(left, int | float)
        else f"; forgotten in {max(0.0, left):.0f} s unless added again"
    )
    return f"{kept.get('id')} (removed): {kept.get('text')}{when}"


def _drained_line(view: dict[str, Any]) -> str:
    """``<replica>: drained by <actor> (<caller>) <age> s ago: <reason>`` under the table (and the
    ``drain_kept`` text of a drain kept from before the replica's removal)."""
    note = view["health"]["drain"]
    age = note.get("at_age_s")
    when = "" if age is None else f" {age:.0f} s ago"
    reason = note.get("reason") or "-"
    kept = view["health"].get("drain_kept")
    line = f"{view.get('id')}: drained by {note.get('by')} ({note.get('caller')}){when}: {reason}"
    return line if not kept else f"{line}; {kept}"


EVENT_PROBLEM_S = 300.0
"""How long after a source's ``last_error`` was last seen the ``events`` column still says ``error``
(seconds); the line under the table keeps it with its age."""


def events_cell(view: dict[str, Any]) -> str:
    """``ok``, ``not-connected`` (a ZMQ source without a publisher: nothing listens, or no PUB),
    ``error`` (a problem seen within :data:`EVENT_PROBLEM_S`), ``silent`` (the engine answered
    requests but published nothing: ``events.hint``) or ``stalled`` (it published, then computed new
    blocks for longer than ``events_stalled_hint_s`` with no batch since: ``events.stalled_s``);
    ``-`` without event sources."""
    sources = (view.get("events") or {}).get("sources") or []
    if not sources:
        return "-"
    if any(source.get("connected") is False for source in sources):
        return "not-connected"
    for source in sources:
        age = source.get("last_error_age_s")
        if source.get("last_error") and isinstance(age, int | float) and age < EVENT_PROBLEM_S:
            return "error"
    events = view.get("events") or {}
    if events.get("stalled_s") is not None:
        return "stalled"
    return "silent" if events.get("hint") else "ok"


def event_problems(views: list[dict[str, Any]]) -> list[str]:
    """One line per replica with an ``events.hint`` and per event source with a ``last_error``: the
    replica, the endpoint, the problem (which names its fix) and how long ago it was last seen."""
    lines: list[str] = []
    for view in views:
        hint = (view.get("events") or {}).get("hint")
        if hint:
            lines.append(f"{view.get('id')} events: {hint}")
        for source in (view.get("events") or {}).get("sources") or []:
            problem = source.get("last_error")
            if not problem:
                continue
            age = source.get("last_error_age_s")
            when = f" ({age:.0f} s ago)" if isinstance(age, int | float) else ""
            lines.append(f"{view.get('id')} {source.get('endpoint')}: {problem}{when}")
    return lines


def routable_cell(view: dict[str, Any]) -> str:
    """``yes``, or ``no`` with why when the view's health says: ``no:draining``,
    ``no:probe-failing``, ``no:wrong-model``, ``no:breaker-open``, ``no:breaker-trial`` (one word,
    for ``awk``)."""
    if view.get("routable"):
        return "yes"
    health = view.get("health") or {}
    if health.get("draining"):
        return "no:draining"
    if health.get("probe_ok") is False:
        return "no:probe-failing"
    if health.get("key_refused"):
        return "no:key-refused"
    if health.get("model_mismatch"):
        return "no:wrong-model"
    breaker = health.get("breaker")
    if breaker == "open":
        return "no:breaker-open"
    if breaker == "half_open":
        return "no:breaker-trial"
    return "no"


def _number(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _rows(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def whatif_table(answer: dict[str, Any]) -> str:
    """``kvlb admin whatif``'s table: the figures before and after, then per replica."""
    before, after = answer["before"], answer["after"]
    head = (
        f"pool {answer['pool']}  policy {answer['policy']}  decisions {answer['decisions']}  "
        f"changed {answer['changed']} ({answer['changed_share']:.1%})"
    )
    figures = _rows(
        ["", "before", "after"],
        [
            [name, _number(before[key]), _number(after[key])]
            for name, key in (
                ("predicted cached tokens", "predicted_cached_tokens"),
                ("hit rate", "hit_rate"),
                ("load spread (max/mean prefill)", "load_spread"),
            )
        ],
    )
    replicas = _rows(
        ["replica", "before share", "after share", "delta"],
        [
            [r["replica"], f"{r['before_share']:.3f}", f"{r['after_share']:.3f}", f"{r['delta_share']:+.3f}"]
            for r in answer["replicas"]
        ],
    )
    changes = [
        f"  #{c['id']}: {c['before']['replica']} -> {c['after']['replica']}" for c in answer.get("sample", [])
    ]
    notes = [f"note: {n}" for n in answer.get("notes", [])]
    parts = [head, figures, replicas]
    if changes:
        parts.append("changed decisions (newest first):\n" + "\n".join(changes))
    return "\n\n".join(parts + (["\n".join(notes)] if notes else []))


def decisions_table(answer: dict[str, Any]) -> str:
    rows = []
    for d in answer["decisions"]:
        cost = d["terms"].get(d["replica"], {}).get("cost")
        rows.append(
            [
                str(d["id"]),
                time.strftime("%H:%M:%S", time.gmtime(d["ts"])),
                d["pool"],
                d["replica"],
                d["tenant"] or "-",
                str(d["prefill_tokens"]),
                str(d["predicted_cached_tokens"]),
                _number(cost, 2),
            ]
        )
    table = _rows(["id", "utc", "pool", "replica", "tenant", "prefill", "cached", "cost"], rows)
    cursor = answer.get("next_since_id")  # absent from a kvlb before 2026-12-01
    return table if cursor is None else f"{table}\nnext: --since-id {cursor}"


def audit_table(answer: dict[str, Any]) -> str:
    rows = []
    for e in answer["entries"]:
        before, after = e["change"]["before"], e["change"]["after"]
        change = ", ".join(f"{k}: {before.get(k)} -> {v}" for k, v in after.items())
        rows.append(
            [
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["ts"])),
                e["actor"],
                str(e["version"]),
                change,
                e["reason"] or "-",
            ]
        )
    return _rows(["utc", "actor", "version", "change", "reason"], rows)


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "whatif": whatif_table,
    "decisions": decisions_table,
    "audit": audit_table,
}
