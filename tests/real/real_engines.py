"""Real vLLM CPU engines and ``kvlb serve`` as child processes, for the opt-in real tests (I/O).

Everything listens on 127.0.0.1, except the engines' ZMQ PUB and replay sockets: vLLM binds only when
the endpoint holds ``*`` (``tcp://*:PORT``); with a host address it *connects out* instead
(docs/reference/real-engines.md §2.2), so the engines bind every interface and every subscriber connects
to 127.0.0.1. Each process is started in its own session and stopped by its PID: SIGTERM, a bounded
wait, then SIGKILL to the process group that PID leads (the API server's EngineCore children).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
REAL_DIR = Path(os.environ.get("KVLB_REAL_DIR", ROOT / ".real"))
VLLM_BIN = REAL_DIR / "venv" / "bin" / "vllm"
MODEL_DIR = REAL_DIR / "models" / "tiny-llama"
MODEL_NAME = "tiny-llama"
TOPIC = "kv-events"
ENGINE_START_TIMEOUT_S = 420.0
"""Engines take 40–70 s to start on an idle 2-core machine; a loaded one can take several times that."""
STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 60.0


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def http_json(
    method: str,
    url: str,
    body: Any = None,
    timeout_s: float = HTTP_TIMEOUT_S,
    headers: dict[str, str] | None = None,
) -> Any:
    """One JSON request; returns the decoded answer (raises on HTTP errors)."""
    answer, _headers = http_json_headers(method, url, body, timeout_s, headers)
    return answer


def http_json_headers(
    method: str,
    url: str,
    body: Any = None,
    timeout_s: float = HTTP_TIMEOUT_S,
    headers: dict[str, str] | None = None,
) -> tuple[Any, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
            headers = {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{method} {url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    return (json.loads(raw) if raw else None), headers


def status_of(
    url: str,
    timeout_s: float = 2.0,
    method: str = "GET",
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> int | None:
    """HTTP status of ``method url`` (a JSON ``body`` if given); ``None`` when nothing answers."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def group_alive(pgid: int) -> list[int]:
    """PIDs still in process group ``pgid`` (read from /proc)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def stop_pid(
    pid: int, process: subprocess.Popen[bytes] | None = None, timeout_s: float = STOP_TIMEOUT_S
) -> None:
    """SIGTERM ``pid``, wait (bounded), then SIGKILL the process group it leads (started with
    ``start_new_session``: the engine's EngineCore and worker children)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            break
        if process is None and not pid_alive(pid):
            break
        time.sleep(0.2)
    deadline = time.monotonic() + 10.0
    while (group_alive(pid) or pid_alive(pid)) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        time.sleep(0.2)
    if process is not None and process.poll() is None:
        process.kill()
        process.wait(timeout=10)
    elif process is not None:
        process.wait(timeout=10)


def engine_env(core: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one vLLM CPU engine: CPU platform, caches under the real dir, no hub, one
    core; ``extra`` (e.g. ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) last."""
    cache = REAL_DIR / "cache"
    tmp = REAL_DIR / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVLB_"))}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        VLLM_CACHE_ROOT=str(cache / "vllm"),
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        XDG_CACHE_HOME=str(cache),
        HF_HOME=str(cache / "hf"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        VLLM_HOST_IP="127.0.0.1",
    )
    env.update(extra or {})
    return env


@dataclass
class VllmReplica:
    """One ``vllm serve`` process: HTTP on 127.0.0.1, events and replay on ``tcp://*``."""

    name: str
    core: int
    block_size: int
    log_dir: Path
    num_blocks: int | None = None
    """``--num-gpu-blocks-override``: a tiny KV cache to force evictions; ``None``: 1 GiB."""
    max_model_len: int = 2048
    """``--max-model-len``; must fit in the KV cache (vLLM refuses to start otherwise)."""
    served_model_name: str = MODEL_NAME
    """``--served-model-name``: the name the engine answers to and lists on ``/v1/models``."""
    api_key_file: Path | None = None
    """A file holding the engine's ``--api-key`` (also kvlb's ``api_key_file`` for this replica)."""
    extra_args: tuple[str, ...] = ()
    """More ``vllm serve`` flags, e.g. ``("--prefix-caching-hash-algo", "sha256_cbor")``."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More environment for the engine, set after :func:`engine_env`'s."""
    ports: list[int] = field(default_factory=lambda: free_ports(3))
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None
    """PID of an engine this test did not start itself (``KVLB_REAL_ATTACH``, a development aid)."""
    starts: int = 0
    start_s: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[1]}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[2]}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def command(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.ports[1]}",
            "replay_endpoint": f"tcp://*:{self.ports[2]}",
            "topic": TOPIC,
        }
        cmd = [
            str(VLLM_BIN), "serve", str(MODEL_DIR), "--host", "127.0.0.1", "--port", str(self.ports[0]),
            "--served-model-name", self.served_model_name, "--max-model-len", str(self.max_model_len),
            "--block-size", str(self.block_size),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
        ]  # fmt: skip
        if self.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.api_key_file is not None:
            cmd += ["--api-key", self.api_key_file.read_text().strip()]
        return [*cmd, *self.extra_args]

    def auth(self) -> dict[str, str]:
        """The header carrying the engine's API key (``{}`` without one)."""
        if self.api_key_file is None:
            return {}
        return {"Authorization": f"Bearer {self.api_key_file.read_text().strip()}"}

    def start(self) -> None:
        """Launch (non-blocking); :meth:`wait_ready` waits for ``/health``."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.pid = None
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(self.core, self.extra_env),
                cwd=REAL_DIR,
                start_new_session=True,
            )
        self._started_at = time.monotonic()

    def wait_ready(self, timeout_s: float = ENGINE_START_TIMEOUT_S) -> float:
        """Seconds from :meth:`start` to ``/health`` 200; raises with the log tail on failure."""
        assert self.process is not None
        deadline = self._started_at + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.process.returncode}:\n{self.log_tail()}")
            if status_of(self.url + "/health") == 200:
                took = time.monotonic() - self._started_at
                self.start_s.append(round(took, 1))
                return took
            time.sleep(1.0)
        raise AssertionError(f"{self.name} not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None:
            stop_pid(self.process.pid, self.process)
        elif self.pid is not None:
            stop_pid(self.pid)
        self.pid = None

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_path
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kvlb_config(self) -> dict[str, Any]:
        """This replica as a kvlb ``pools[].replicas`` entry (vLLM speaks SGLang's event format)."""
        entry: dict[str, Any] = {
            "id": self.name,
            "url": self.url,
            "engine": "vllm",
            "block_size": self.block_size,
            "events": self.events,
            "replay": self.replay,
            "topic": TOPIC,
        }
        if self.api_key_file is not None:
            entry["api_key_file"] = str(self.api_key_file)
        return entry


@dataclass
class KvlbServe:
    """``kvlb serve`` in a child process of the project venv, on a free port of 127.0.0.1."""

    config_path: Path
    log_dir: Path
    process: subprocess.Popen[bytes] | None = None
    url: str = ""
    starts: int = 0
    name: str = "kvlb"

    @classmethod
    def configure(
        cls, tmp: Path, replicas: list[VllmReplica], policy: str = "cost", name: str = "kvlb"
    ) -> KvlbServe:
        """A config of one pool (the model :data:`MODEL_NAME`) over ``replicas``, written to
        ``tmp/<name>.yaml``; logs go to ``tmp/<name>-<start>.log``."""
        config = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [
                {
                    "model": MODEL_NAME,
                    "tokenizer": str(MODEL_DIR),  # the engine's own tokenizer files and chat template
                    "replicas": [r.kvlb_config() for r in replicas],
                }
            ],
            "policy": {"name": policy, "seed": 7},
            "scrape_interval_s": 1.0,
            "health_interval_s": 1.0,
        }
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return cls(path, tmp, name=name)

    def start(self, timeout_s: float = 60.0) -> float:
        self.starts += 1
        log = (self.log_dir / f"{self.name}-{self.starts}.log").open("wb")
        started = time.monotonic()
        self.process = subprocess.Popen(
            # one worker: the checks read one process's index, metrics and receipts
            [sys.executable, "-m", "balancer", "serve", "--config", str(self.config_path), "--workers", "1"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=ROOT,
            # kvlb reads KVLB_* as settings: the test's own switches must not reach it.
            env={k: v for k, v in os.environ.items() if not k.startswith("KVLB_")},
            start_new_session=True,
        )
        log.close()
        assert self.process.stdout is not None
        os.set_blocking(self.process.stdout.fileno(), False)
        buffer = b""
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise AssertionError(f"kvlb exited {self.process.returncode}:\n{self.log_tail()}")
            chunk = self.process.stdout.read() or b""
            buffer += chunk
            for line in buffer.splitlines():
                if line.startswith(b"{") and b'"serving"' in line:
                    self.url = json.loads(line)["url"]
                    return time.monotonic() - started
            time.sleep(0.1)
        raise AssertionError(f"kvlb did not start:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None:
            stop_pid(self.process.pid, self.process, timeout_s=15.0)
            if self.process.stdout is not None:
                self.process.stdout.close()

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / f"{self.name}-{self.starts}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def replicas(self) -> dict[str, dict[str, Any]]:
        """``GET /admin/replicas`` keyed by replica id."""
        views = http_json("GET", self.url + "/admin/replicas")["replicas"]
        return {v["id"]: v for v in views}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` on ``/metrics`` whose labels include ``labels``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total
