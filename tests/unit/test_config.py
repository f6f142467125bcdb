"""Settings loading: defaults, YAML, env and --set precedence, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from balancer import config
from balancer.errors import ConfigError

YAML = """
listen: {port: 9100}
pools:
  - model: m1
    replicas:
      - {id: a, url: "http://127.0.0.1:1", engine: sglang, block_size: 16, events: "tcp://127.0.0.1:5557"}
      - {id: b, url: "http://127.0.0.1:2", engine: trtllm, block_size: 32}
policy: {name: cost, weights: {overlap_credit: 0.5}}
"""


def test_defaults_validate() -> None:
    settings = config.load(env={})
    assert settings.listen.port == 8000
    assert settings.pools == ()
    assert settings.redis.url is None


def test_yaml_env_and_set_precedence(tmp_path: Path) -> None:
    path = tmp_path / "kvlb.yaml"
    path.write_text(YAML)
    env = {"KVLB_LISTEN__PORT": "9200", "KVLB_REDIS__URL": "redis://127.0.0.1:7", "HOME": "/x"}
    settings = config.load(path, sets=["listen.port=9300", "limits.max_retries=0"], env=env)
    assert settings.listen.port == 9300  # --set beats env beats file
    assert settings.redis.url == "redis://127.0.0.1:7"
    assert settings.limits.max_retries == 0
    assert [r.id for r in settings.pools[0].replicas] == ["a", "b"]
    assert settings.pools[0].replicas[1].engine == "trtllm"
    assert settings.policy.weights == {"overlap_credit": 0.5}


SERVICE_LINKS = {  # what the kubelet sets in every pod of the namespace of Services kvlb and kvlb-redis
    "KVLB_SERVICE_HOST": "10.96.0.10",
    "KVLB_SERVICE_PORT": "8000",
    "KVLB_SERVICE_PORT_HTTP": "8000",
    "KVLB_SERVICE_PORT_GRPC": "50051",
    "KVLB_PORT": "tcp://10.96.0.10:8000",
    "KVLB_PORT_8000_TCP": "tcp://10.96.0.10:8000",
    "KVLB_PORT_8000_TCP_PROTO": "tcp",
    "KVLB_PORT_8000_TCP_PORT": "8000",
    "KVLB_PORT_8000_TCP_ADDR": "10.96.0.10",
    "KVLB_PORT_50051_TCP": "tcp://10.96.0.10:50051",
    "KVLB_REDIS_SERVICE_HOST": "10.96.0.11",
    "KVLB_REDIS_SERVICE_PORT": "6379",
    "KVLB_REDIS_SERVICE_PORT_REDIS": "6379",
    "KVLB_REDIS_PORT": "tcp://10.96.0.11:6379",
    "KVLB_REDIS_PORT_6379_TCP_ADDR": "10.96.0.11",
}


def test_kubernetes_service_links_are_not_settings() -> None:
    """Kubernetes sets ``KVLB_PORT=tcp://...`` and the like in every pod of a namespace with a Service
    named ``kvlb`` (the manifests' own): they are skipped, the real settings beside them still apply,
    and a typo'd setting is still refused. Before 2026-12-01 they were read as settings and ``kvlb
    serve`` exited 2 (``config: unknown key(s) ['port', 'port_8000_tcp', ...]``)."""
    env = {**SERVICE_LINKS, "KVLB_LISTEN__PORT": "9200", "KVLB_LOG_LEVEL": "debug"}
    settings = config.load(env=env)
    assert settings.listen.port == 9200 and settings.log_level == "debug"
    with pytest.raises(ConfigError, match="unknown key"):
        config.load(env={**SERVICE_LINKS, "KVLB_LISTN__PORT": "1"})


def test_redis_cluster_setting() -> None:
    settings = config.load(sets=["redis.url=redis://h:7000/0", "redis.cluster=true"], env={})
    assert settings.redis.cluster
    settings = config.load(env={"KVLB_REDIS__URL": "redis://h:7000", "KVLB_REDIS__CLUSTER": "true"})
    assert settings.redis.cluster and settings.redis.url == "redis://h:7000"


def test_config_file_from_env(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listen: {port: 1234}\n")
    assert config.load(env={"KVLB_CONFIG": str(path)}).listen.port == 1234


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["listen.prot=1"], "unknown key"),
        (["listen.port=abc"], "expected an integer"),
        (["limits.max_inflight=0"], "limits.max_inflight must be > 0"),
        (["limits.max_event_blocks=0"], "limits.max_event_blocks must be > 0"),
        (["limits.max_body_chunks=0"], "limits.max_body_chunks must be > 0"),
        (["limits.event_queue_bytes=0"], "limits.event_queue_bytes must be > 0"),
        (["limits.event_message_bytes=0"], "limits.event_message_bytes must be > 0"),
        (["health_timeouts_to_drop=0"], r"health_timeouts_to_drop must be in \[1, 10\]"),
        (["health_timeouts_to_drop=11"], r"health_timeouts_to_drop must be in \[1, 10\]"),
        (["limits.gap_hold_s=-1"], r"limits.gap_hold_s must be in \[0, 60\]"),
        (["limits.event_ingest_cpu_share=0"], "limits.event_ingest_cpu_share must be > 0"),
        (["limits.event_ingest_cpu_burst_s=61"], r"limits.event_ingest_cpu_burst_s must be in \(0, 60\]"),
        (["limits.event_max_behind_s=0"], r"limits.event_max_behind_s must be in \(0, 60\]"),
        (["limits.gap_hold_s=61"], r"limits.gap_hold_s must be in \[0, 60\]"),
        (["limits.token_id_memo_runs=-1"], r"limits.token_id_memo_runs must be in \[0, 1048576\]"),
        (["limits.segment_cache_bytes=-1"], r"limits.segment_cache_bytes must be in \[0, 17179869184\]"),
        (["limits.segment_cache_bytes=17179869185"], r"limits.segment_cache_bytes must be in \[0, "),
        (["limits.max_reserved_bytes=0"], r"limits.max_reserved_bytes must be in \[1, 1099511627776\]"),
        (
            ["limits.max_body_bytes=4096", "limits.max_inflight_body_bytes=4095"],
            r"limits.max_inflight_body_bytes must be in \[limits.max_body_bytes, 1099511627776\] "
            r"\(here \[4096, ",
        ),
        (["limits.max_inflight_body_bytes=1099511627777"], "limits.max_inflight_body_bytes must be in"),
        (["console.decision_ring_size=-1"], "console.decision_ring_size must be in"),
        (["console.decision_ring_bytes=0"], "console.decision_ring_bytes must be > 0"),
        (["tenant_header=a b"], "tenant_header must be a header name"),
        (["console.tenant_header=a b"], "tenant_header must be a header name"),
        (["tenant_header=x-a", "console.tenant_header=x-b"], "console.tenant_header .* is the old name"),
        (
            ["limits.max_inflight_per_tenant=0"],
            r"limits.max_inflight_per_tenant must be in \[1, limits.max_inflight\]",
        ),
        (
            ["limits.max_inflight=8", "limits.max_inflight_per_tenant=9"],
            r"limits.max_inflight_per_tenant must be in \[1, limits.max_inflight\] \(here \[1, 8\]\), got 9",
        ),
        (
            ["limits.max_queued_per_tenant=-1"],
            r"limits.max_queued_per_tenant must be in \[0, limits.max_queued\]",
        ),
        (
            ["limits.max_queued=4", "limits.max_queued_per_tenant=5"],
            r"limits.max_queued_per_tenant must be in \[0, limits.max_queued\] \(here \[0, 4\]\), got 5",
        ),
        (
            ["limits.max_inflight_prompt_tokens_per_tenant=-1"],
            "limits.max_inflight_prompt_tokens_per_tenant must be >= 0, got -1",
        ),
        (["limits.prefill_tokens_per_s=0"], "limits.prefill_tokens_per_s must be a finite number > 0"),
        (
            ["limits.max_tokenizing_per_tenant=0"],
            r"limits.max_tokenizing_per_tenant must be in \[1, limits.max_inflight\]",
        ),
        (
            ["limits.max_inflight=4", "limits.max_tokenizing_per_tenant=5"],
            r"limits.max_tokenizing_per_tenant must be in \[1, limits.max_inflight\] "
            r"\(here \[1, 4\]\), got 5",
        ),
        (["limits.max_tenants=0"], r"limits.max_tenants must be in \[1, 65536\]"),
        (["limits.tenant_rate_per_s=-1"], r"limits.tenant_rate_per_s must be a finite number >= 0"),
        (["limits.tenant_rate_per_s=inf"], r"limits.tenant_rate_per_s must be a finite number >= 0"),
        (["limits.tenant_burst=0"], r"limits.tenant_burst must be in \[1, 1000000\], got 0"),
        (["limits.tenant_rate_tenants=0"], r"limits.tenant_rate_tenants must be in \[1, 1048576\]"),
        (["limits.tenant_rate_new_per_s=0"], r"limits.tenant_rate_new_per_s must be a finite number > 0"),
        (["limits.max_tenants=65537"], r"limits.max_tenants must be in \[1, 65536\]"),
        (["limits.load_share_tenant_slots=0"], r"limits.load_share_tenant_slots must be in \[1, 65536\]"),
        (["limits.load_share_tenant_slots=65537"], r"limits.load_share_tenant_slots must be in \[1, 65536\]"),
        (["console.audit_log_size=0"], "console.audit_log_size must be >= 1"),
        (["console.whatif_max_entries=0"], "console.whatif_max_entries must be >= 1"),
        (["console.whatif_max_cache_marks=0"], r"console.whatif_max_cache_marks must be in \[1, 10000000\]"),
        (["console.whatif_max_cache_marks=10000001"], "console.whatif_max_cache_marks must be in"),
        (["upstream.max_connections=0"], r"upstream.max_connections must be in \[1, 65536\]"),
        (["upstream.idle_ttl_s=0"], r"upstream.idle_ttl_s must be in \[0.1, 3600\]"),
        (["upstream.max_header_bytes=100"], "upstream.max_header_bytes must be in"),
        (["redis.url=http://x"], "redis.url must start with"),
        (["redis.cluster=true"], "redis.cluster needs redis.url"),
        (["redis.url=redis://h:7000/2", "redis.cluster=true"], "database must be 0"),
        (["redis.url=redis://:pa/ss@h:6379/0"], r"redis.url: the port is not a number .*%2F"),
        (["redis.url=redis://:pa#ss@h:6379/0"], "redis.url: the port is not a number"),
        (["redis.url=redis://h:99999/0"], "redis.url: the port is not a number"),
        (["redis.url=redis://h:6379/kvlb"], "the database .* must be a number"),
        (["redis.url=redis://:secret@/0"], "redis.url names no host"),
        (["redis.url=redis://h:6379/0", "redis.tls_ca_file=/ca.crt"], "tls_ca_file needs a rediss://"),
        (["redis.tls_ca_file=/ca.crt"], "tls_ca_file needs a rediss://"),
        (["pools=[{model: m, replicas: [{id: a, url: 'ftp://x'}]}]"], "url must be http"),
        # until 2026-12-01 (h-configrules) these were accepted and failed only at run time, or never
        (
            ["pools=[{model: m, replicas: [{id: a, url: 'http://'}]}]"],
            r"replica a: url must be http\(s\)://host",
        ),
        (
            ["pools=[{model: m, replicas: [{id: a, url: 'http://h:1', replay: 'udp://h:1'}]}]"],
            "replica a: replay must be tcp://host:port or ipc://path, got 'udp://h:1'",
        ),
        (
            ["pools=[{model: m, replicas: [{id: a, url: 'http://h:1', events: 'tcp://h'}]}]"],
            "replica a: events must be tcp://host:port or ipc://path",
        ),
        (["tenant_header=x-tenánt"], "tenant_header must be a header name"),
        (["discovery.api_url=https://"], r"discovery.api_url must be http\(s\)://"),
        (["pools=[{model: m, replicas: [{id: a, url: 'http://x', engine: foo}]}]"], "must be one of"),
        (
            ["pools=[{model: m, replicas: [{id: a, url: 'http://x'}, {id: a, url: 'http://y'}]}]"],
            "appears twice",
        ),
        (["nonsense"], "name=value"),
        (["listen.port=65536"], r"listen.port must be in \[0, 65535\], got 65536"),
        (["listen.grpc_port=-1"], r"listen.grpc_port must be in \[0, 65535\], got -1"),
        (["policy.name=nope"], "unknown policy 'nope'; known: cost, "),
        (["policy.weights={overlap_credit: 9}"], r"policy.overlap_credit must be in \[0, 4\], got 9.0"),
        (["log_level=loud"], "log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"),
        (["slo.ttft_s=0"], r"slo.ttft_s must be in \[0.001, 3600\], got 0.0"),
        (["slo.ttft_target_ratio=1"], r"slo.ttft_target_ratio must be in \(0, 1\), got 1.0"),
    ],
)
def test_bad_settings_name_the_field(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.load(sets=sets, env={})


def test_a_bad_redis_url_is_refused_without_its_password() -> None:
    """Before 2026-12-01 a port that was no number stopped ``kvlb serve`` with a traceback from
    redis-py, and a database that was no number was taken as 0."""
    for url in ("redis://:pa/ss@h:6379/0", "redis://:s3cret@h:6379/kvlb"):
        with pytest.raises(ConfigError) as raised:
            config.load(sets=[f"redis.url={url}"], env={})
        assert "pa/ss" not in str(raised.value) and "s3cret" not in str(raised.value)
    for url in ("redis://h", "redis://u:p%2F@h:6379/", "rediss://h:6380/3"):
        assert config.load(sets=[f"redis.url={url}"], env={}).redis.url == url


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        config.load(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad, env={})
    top = tmp_path / "top.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        config.load(top, env={})


def test_a_pool_without_kv_events_needs_a_positive_approx_ttl() -> None:
    pool = {"model": "m", "kv_events": False, "approx_ttl_s": 30}
    settings = config.from_mapping(config.Settings, {"pools": [pool]}).validate()
    assert (settings.pools[0].kv_events, settings.pools[0].approx_ttl_s) == (False, 30.0)
    assert config.from_mapping(config.Settings, {"pools": [{"model": "m"}]}).pools[0].kv_events
    assert not config.Settings().limits.receipt_drops
    with pytest.raises(ConfigError, match="approx_ttl_s"):
        config.from_mapping(config.Settings, {"pools": [{**pool, "approx_ttl_s": 0}]}).validate()


def test_upstream_connection_bounds_are_settings() -> None:
    settings = config.load(
        sets=["upstream.max_connections=8", "upstream.max_headers=16"],
        env={"KVLB_UPSTREAM__IDLE_TTL_S": "2.5"},
    )
    assert (
        settings.upstream.max_connections,
        settings.upstream.max_headers,
        settings.upstream.idle_ttl_s,
    ) == (8, 16, 2.5)
    assert settings.upstream.max_idle_per_host == 256


def test_the_allocator_setting_and_the_environment_it_re_executes_with() -> None:
    auto = config.load(env={})
    assert auto.allocator == "auto" and auto.jemalloc_library == "libjemalloc.so.2"
    jemalloc = config.load(env={"KVLB_ALLOCATOR": "jemalloc"})
    assert jemalloc.allocator == "jemalloc"
    system = config.load(env={"KVLB_ALLOCATOR": "system"})
    with pytest.raises(ConfigError, match="allocator"):
        config.load(env={}, sets=["allocator=tcmalloc"])
    for bad in ("", "lib a.so", "a.so:b.so"):
        with pytest.raises(ConfigError, match="jemalloc_library"):
            config.load(env={}, sets=[f"jemalloc_library={bad}"])
    # the system allocator, or jemalloc already preloaded (the re-executed process, a worker): no exec
    assert config.allocator_environ(system, {"PATH": "/bin"}, found=True) is None
    preloaded = {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}
    for wanted in (auto, jemalloc):
        assert config.allocator_environ(wanted, preloaded, found=True) is None
        assert config.allocator_environ(wanted, {"PATH": "/bin"}, found=False) is None  # not installed
        # otherwise the same environment with the library appended to what is already preloaded
        # otherwise the same environment with the library appended to what is already preloaded, and
        # jemalloc's background purging on unless MALLOC_CONF says otherwise
        assert config.allocator_environ(wanted, {"PATH": "/bin"}, found=True) == {
            "PATH": "/bin",
            "LD_PRELOAD": "libjemalloc.so.2",
            "MALLOC_CONF": "background_thread:true",
        }
    other = config.allocator_environ(
        jemalloc, {"LD_PRELOAD": "libother.so", "MALLOC_CONF": "narenas:1"}, found=True
    )
    assert other == {"LD_PRELOAD": "libother.so libjemalloc.so.2", "MALLOC_CONF": "narenas:1"}
    # a library named by path: preloaded once (its own name marks the re-executed process)
    custom = config.load(env={}, sets=["jemalloc_library=/opt/je/libje.so"])
    env = config.allocator_environ(custom, {}, found=True)
    assert env == {"LD_PRELOAD": "/opt/je/libje.so", "MALLOC_CONF": "background_thread:true"}
    assert config.allocator_environ(custom, env, found=True) is None


def test_a_jemalloc_library_is_found_by_path_or_by_soname(tmp_path: Path) -> None:
    library = tmp_path / "libjemalloc.so.2"
    assert not config.jemalloc_found(str(library))  # a path that does not exist
    library.write_bytes(b"")
    assert config.jemalloc_found(str(library))
    assert not config.jemalloc_found("libkvlb-no-such-allocator.so.9")  # not in the loader's cache
    assert not config.jemalloc_found("lib.so")


def test_the_tenant_header_moved_out_of_console_and_its_old_name_still_works() -> None:
    """One header names the tenant for admission and the console: ``tenant_header``; the old key
    ``console.tenant_header`` (file, ``--set`` or environment) sets it, and the per-tenant caps are
    unset by default (the global caps then bind: nothing changes without tenants)."""
    default = config.load(env={})
    assert default.tenant_header == "x-kvlb-tenant"
    assert default.limits.max_inflight_per_tenant is None and default.limits.max_queued_per_tenant is None
    assert default.limits.max_tenants == 1024
    assert config.load(sets=["console.tenant_header=x-org"], env={}).tenant_header == "x-org"
    assert config.load(env={"KVLB_CONSOLE__TENANT_HEADER": "x-team"}).tenant_header == "x-team"
    assert (
        config.load(sets=["tenant_header=x-org", "console.tenant_header=x-org"], env={}).tenant_header
        == "x-org"
    )
    capped = config.load(sets=["limits.max_inflight_per_tenant=3", "limits.max_queued_per_tenant=0"], env={})
    assert (capped.limits.max_inflight_per_tenant, capped.limits.max_queued_per_tenant) == (3, 0)
    assert default.limits.max_inflight_prompt_tokens_per_tenant is None
    assert default.limits.max_tokenizing_per_tenant is None
    assert default.limits.tenant_rate_default_tenant is False  # the default tenant: no rate unless opted in
    opted = config.load(sets=["limits.tenant_rate_default_tenant=true"], env={})
    assert opted.limits.tenant_rate_default_tenant is True
    tokens = config.load(sets=["limits.max_inflight_prompt_tokens_per_tenant=16000"], env={})
    assert tokens.limits.max_inflight_prompt_tokens_per_tenant == 16000
    assert default.limits.tenant_rate_per_s == 0.0 and default.limits.tenant_burst is None  # off
    assert default.limits.tenant_rate_tenants == 4096 and default.limits.tenant_rate_new_per_s is None
    rated = config.load(env={"KVLB_LIMITS__TENANT_RATE_PER_S": "2.5", "KVLB_LIMITS__TENANT_BURST": "5"})
    assert (rated.limits.tenant_rate_per_s, rated.limits.tenant_burst) == (2.5, 5)


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        (  # two replicas given one engine's events (a copied entry): its blocks credited to both
            "[{id: a, url: 'http://x', events: 'tcp://h:5557'}, {id: b, url: 'http://y', events: 'tcp://h:5557'}]",
            "replica b rank 0 events endpoint tcp://h:5557 is also replica a rank 0 events's",
        ),
        (  # rank 1 of a (port + 1) is b's rank 0
            "[{id: a, url: 'http://x', events: 'tcp://h:5557', dp_size: 2},"
            " {id: b, url: 'http://y', events: 'tcp://h:5558'}]",
            "replica b rank 0 events endpoint tcp://h:5558 is also replica a rank 1 events's",
        ),
        (  # b's replay is a's events: b would take a's engine for its replay socket
            "[{id: a, url: 'http://x', events: 'ipc:///run/kv'},"
            " {id: b, url: 'http://y', events: 'ipc:///run/kv2', replay: 'ipc:///run/kv'}]",
            "replica b rank 0 replay endpoint ipc:///run/kv is also replica a rank 0 events's",
        ),
    ],
)
def test_an_event_endpoint_claimed_twice_is_refused(replicas: str, message: str) -> None:
    """The engine walk of 2026-12-01 (h-enginewalk): two replicas given the same events endpoint
    both subscribed to one engine, and its blocks were credited to both (routing to the second
    predicted hits its engine never had), with no word."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config.load(sets=[f"pools=[{{model: m, replicas: {replicas}}}]"], env={})


def test_distinct_event_endpoints_and_a_pool_without_events_pass() -> None:
    config.load(
        sets=[
            "pools=[{model: m, replicas: [{id: a, url: 'http://x', events: 'tcp://h:5557', replay: 'tcp://h:5559',"
            " dp_size: 2}, {id: b, url: 'http://y', events: 'tcp://g:5557', replay: 'tcp://g:5558'}]},"
            " {model: n, kv_events: false, replicas: [{id: c, url: 'http://z', events: 'tcp://h:5557'}]},"
            # one replica's own ranks running into each other: said by its sources at run time
            " {model: o, replicas: [{id: d, url: 'http://w', events: 'tcp://k:5557', replay: 'tcp://k:5558',"
            " dp_size: 2}]}]"
        ],
        env={},
    )
