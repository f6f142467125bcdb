"""The routers a load test compares: kvlb policies and the installed peers (pure command building).

A router is named on the command line:

* ``kvlb`` is kvlb's default policy (``cost``); ``round_robin``, ``least_load``, ``power_of_two``
  are kvlb's baselines; ``kvlb:<policy>`` is any kvlb policy (e.g. ``kvlb:sglang_threshold``), and
  ``kvlb:<policy>+<weight>=<value>+…`` the same with policy weights changed (``docs/policies.md``),
  e.g. ``kvlb:cost+decode_weight=0.1``; ``null`` unsets an optional weight, e.g.
  ``kvlb:cost+overlap_credit_loaded=null+root_weight=0`` (the default policy before 2026-11-29).
* ``kvlb_no_events``: kvlb's default policy on a pool with ``kv_events: false``: no KV event is read;
  the index learns only from routing decisions and receipts (``docs/prefix-index.md``). A suffix
  ``~no_events`` does the same for any kvlb router, e.g. ``kvlb:cost+decode_weight=0.1~no_events``.
* ``sglang_cache_aware``: ``sglang-router`` (pip ``sglang-router``) with ``--policy cache_aware``,
  its defaults otherwise (cache threshold 0.3, balance thresholds 64 / 1.5). It keeps a text tree
  of routed requests; it reads no KV events.
* ``vllm_kv_aware``: ``vllm-router`` (pip ``vllm-router``) with ``--policy kv_aware``: one
  ``--kv-event-source URL=tcp://…`` per replica (the emulator's SGLang-format ZMQ events), block size
  the replicas' page size, and ``POST /v1/chat/completions/render`` to every worker per request to
  learn the token ids.

Peers are run on 127.0.0.1 only, with the Hugging Face hub closed (:data:`PEER_ENV`): the replicas
report a local ``model_path`` for the tokenizer (``docs/loadtest.md``).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

RouterKind = Literal["kvlb", "sglang", "vllm", "replay"]

KVLB_BASELINES: tuple[str, ...] = ("round_robin", "least_load", "power_of_two")
PEER_NAMES: tuple[str, ...] = ("sglang_cache_aware", "vllm_kv_aware")
DEFAULT_ROUTERS: tuple[str, ...] = ("kvlb", *KVLB_BASELINES, *PEER_NAMES)

PEER_ENV: Mapping[str, str] = {
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}
"""Environment added for peers: the hub points at a closed loopback port and offline mode is on."""

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One router to run: its display name, what runs it and (kvlb) the policy."""

    name: str
    kind: RouterKind
    policy: str
    """kvlb policy name, or the peer's ``--policy`` value."""
    weights: tuple[tuple[str, float | None], ...] = ()
    """kvlb policy weight overrides (name, value; ``None`` for ``null``, an optional weight unset)."""
    kv_events: bool = True
    """kvlb: read the replicas' KV events (``False``: the pool's ``kv_events: false``)."""

    @property
    def is_peer(self) -> bool:
        return self.kind in ("sglang", "vllm")

    @property
    def replica_header(self) -> str:
        """Response header naming the replica: kvlb's own, or the emulator's (peers pass it through;
        a replay talks to the replicas)."""
        return "x-kvlb-replica" if self.kind == "kvlb" else "x-sim-replica"


NO_EVENTS_SUFFIX = "~no_events"
REPLAY_PREFIX = "replay:"


def replay_router(of: str) -> RouterSpec:
    """No router: each request goes straight to the replica a simulation of router ``of`` chose for
    it (:func:`loadtests.runs.run_router` with an assignment). Used by ``kvlb capacity
    --confirm-replay`` to separate the routing from the replicas' timing."""
    return RouterSpec(REPLAY_PREFIX + of, "replay", "replay")


def parse_router(name: str) -> RouterSpec:
    """A router name (module docstring) → its spec; ``ValueError`` for an unknown one."""
    text = name.strip()
    if text == "kvlb_no_events":
        return RouterSpec(text, "kvlb", "cost", kv_events=False)
    if text.endswith(NO_EVENTS_SUFFIX) and len(text) > len(NO_EVENTS_SUFFIX):
        base = parse_router(text[: -len(NO_EVENTS_SUFFIX)])
        if base.kind != "kvlb":
            raise ValueError(f"router {text!r}: {NO_EVENTS_SUFFIX} applies to kvlb routers only")
        return RouterSpec(text, "kvlb", base.policy, base.weights, kv_events=False)
    if text == "kvlb":
        return RouterSpec("kvlb", "kvlb", "cost")
    if text in KVLB_BASELINES:
        return RouterSpec(text, "kvlb", text)
    if text.startswith("kvlb:") and text[5:]:
        policy, *pairs = text[5:].split("+")
        weights: list[tuple[str, float | None]] = []
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"router {text!r}: expected <weight>=<number or null>, got {pair!r}")
            if value.strip() == "null":
                weights.append((name.strip(), None))
                continue
            try:
                weights.append((name.strip(), float(value)))
            except ValueError:
                expected = "expected <weight>=<number or null>"
                raise ValueError(f"router {text!r}: {expected}, got {pair!r}") from None
        return RouterSpec(text, "kvlb", policy, tuple(weights))
    if text == "sglang_cache_aware":
        return RouterSpec(text, "sglang", "cache_aware")
    if text == "vllm_kv_aware":
        return RouterSpec(text, "vllm", "kv_aware")
    known = ", ".join((*DEFAULT_ROUTERS, "kvlb_no_events", "kvlb:<policy>", "<kvlb router>~no_events"))
    raise ValueError(f"unknown router {name!r}; known: {known}")


def peer_available(spec: RouterSpec) -> bool:
    """Whether the peer's pip package is installed in this interpreter's environment."""
    if spec.kind == "sglang":
        return importlib.util.find_spec("sglang_router") is not None
    if spec.kind == "vllm":
        return vllm_router_executable() is not None
    return True


def vllm_router_executable() -> str | None:
    """``vllm-router`` next to this interpreter (the venv), else on ``PATH``."""
    beside = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    return beside or shutil.which("vllm-router")


def _check_loopback(urls: Sequence[str]) -> None:
    for url in urls:
        host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        if host not in (LOOPBACK, "localhost"):
            raise ValueError(f"peers run on loopback only; refusing worker address {url!r}")


def peer_command(
    spec: RouterSpec,
    *,
    port: int,
    metrics_port: int,
    replicas: Sequence[Mapping[str, Any]],
    model: str,
) -> list[str]:
    """argv of the peer in front of ``replicas`` (listing entries: ``url``, ``events``, ``block_size``)."""
    urls = [str(r["url"]) for r in replicas]
    _check_loopback(urls)
    common = [
        "--host", LOOPBACK, "--port", str(port), "--worker-urls", *urls,
        "--policy", spec.policy, "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port),
    ]  # fmt: skip
    if spec.kind == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    if spec.kind != "vllm":
        raise ValueError(f"{spec.name} is not a peer")
    executable = vllm_router_executable()
    if executable is None:
        raise ValueError("vllm-router is not installed")
    sources: list[str] = []
    for replica in replicas:
        events = list(replica.get("events") or [])
        if not events:
            raise ValueError(f"vllm_kv_aware needs SGLang-format ZMQ events; {replica['url']} has none")
        _check_loopback([str(events[0])])
        sources += ["--kv-event-source", f"{replica['url']}={events[0]}"]
        replay = list(replica.get("replay") or [])
        if replay:
            sources += ["--kv-event-replay-source", f"{replica['url']}={replay[0]}"]
    block_size = int(replicas[0]["block_size"])
    return [
        executable, *common, *sources,
        "--kv-event-block-size", str(block_size), "--kv-event-model", model, "--log-level", "warning",
    ]  # fmt: skip
