"""``kvlb serve`` (run the balancer) and ``kvlb admin`` (talk to a running one's admin API) (I/O).

``kvlb serve`` prints one JSON line ``{"kvlb": "serving", "url": ...}`` on stdout once it listens
(useful with ``--set listen.port=0``), logs to stderr, and shuts down in order on SIGTERM or SIGINT.
``kvlb admin`` prints the server's JSON answer on stdout; an error answer goes to stderr, exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeAlias

import yaml

from balancer import strict_json
from balancer.app import Balancer, ServeOptions, WorkerRole
from balancer.cli.workers import supervise
from balancer.config import Settings, load
from balancer.errors import ConfigError

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
    parser.add_argument("--log-level", default=None, help="logging level (default: the log_level setting)")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="worker processes serving the port (default: the number of cores, %(default)s); 1 serves "
        "in this process",
    )
    # Set by the supervisor of --workers N for each worker it starts (docs/architecture.md).
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(handler=run_serve)


def default_workers() -> int:
    """``--workers`` by default: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``kvlb serve`` options a worker gets from its supervisor (all but the worker ones)."""
    argv: list[str] = []
    if args.config:
        argv += ["--config", str(args.config)]
    for item in args.set:
        argv += ["--set", item]
    argv += ["--shutdown-grace-s", str(args.shutdown_grace_s)]
    if args.log_level:
        argv += ["--log-level", args.log_level]
    if args.no_uvloop:
        argv.append("--no-uvloop")
    return argv


def run_serve(args: argparse.Namespace) -> int:
    try:
        settings = load(args.config, args.set)
    except ConfigError as exc:
        print(f"kvlb serve: {exc}", file=sys.stderr)
        return 2
    level = (args.log_level or settings.log_level).upper()
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
        role = WorkerRole(args.worker_index, args.workers, args.listen_fd, args.run_dir)
        _die_with_parent()
    elif args.workers > 1:
        supervise_run = supervise(settings, args.workers, worker_argv(args), args.shutdown_grace_s)
        try:
            _runner(not args.no_uvloop)(supervise_run)
        except ConfigError as exc:
            print(f"kvlb serve: {exc}", file=sys.stderr)
            return 2
        return 0
    options = ServeOptions(shutdown_grace_s=args.shutdown_grace_s, worker=role)
    try:
        _runner(not args.no_uvloop)(serve(settings, options))
    except ConfigError as exc:
        print(f"kvlb serve: {exc}", file=sys.stderr)
        return 2
    return 0


async def serve(settings: Settings, options: ServeOptions) -> None:
    """Run until SIGTERM/SIGINT, then stop in order (a second signal is ignored: shutdown is bounded
    by ``shutdown_grace_s``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    balancer = Balancer(settings, options=options)
    orphan_watch = None
    if options.worker is not None:  # a worker ends with its supervisor, even one killed with -9
        orphan_watch = asyncio.create_task(_stop_when_orphaned(os.getppid(), stop), name="kvlb-orphan-watch")
    try:
        await balancer.start()
        print(strict_json.dumps({"kvlb": "serving", "url": balancer.url}), flush=True)
        await stop.wait()
        log.info("signal received: draining for up to %.1fs, then stopping", options.shutdown_grace_s)
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
        await balancer.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log.info("stopped")


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel sends this worker SIGKILL when its supervisor dies (even by SIGKILL), so no
    orphan keeps the listener; elsewhere :func:`_stop_when_orphaned` notices within a second."""
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
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="balancer URL (default %(default)s)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", help="admin bearer token (auth.admin_token)")
    token.add_argument("--token-file", type=Path, help="file holding the admin token (keeps it out of ps)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="HTTP timeout (default %(default)s)")
    actions = parser.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    policy = actions.add_parser("policy", help="show or change the routing policy")
    policy_actions = policy.add_subparsers(dest="policy_command", metavar="get|set", required=True)
    policy_actions.add_parser("get", help="print the policy in force")
    setter = policy_actions.add_parser("set", help="change it: name=cost overlap_credit=0.5 ...")
    setter.add_argument("pairs", nargs="+", metavar="NAME=VALUE", help="'name' or a weight (null clears)")
    explain = actions.add_parser("explain", help="dry-run routing of a request body")
    explain.add_argument("file", help="JSON request body file ('-' for stdin)")
    actions.add_parser("replicas", help="health, load, index and events per replica")
    for name in ("drain", "undrain"):
        action = actions.add_parser(name, help=f"{name} a replica")
        action.add_argument("replica", help="replica id")
    parser.set_defaults(handler=run_admin)


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
        return "PUT", "/admin/policy", body
    if command == "explain":
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text("utf-8")
        return "POST", "/admin/explain", json.loads(text)
    if command == "replicas":
        return "GET", "/admin/replicas", None
    return "POST", f"/admin/replicas/{args.replica}/{command}", None


def run_admin(args: argparse.Namespace) -> int:
    try:
        method, path, body = admin_request(args)
        token = args.token_file.read_text("utf-8").strip() if args.token_file else args.token
        data = None if body is None else json.dumps(body, allow_nan=False).encode("utf-8")  # strict JSON
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"kvlb admin: {exc}", file=sys.stderr)
        return 2
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        print(f"kvlb admin: HTTP {exc.code}: {exc.read().decode('utf-8', 'replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, TimeoutError, ValueError) as exc:
        print(f"kvlb admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(strict_json.dumps(answer, indent=2))
    return 0
