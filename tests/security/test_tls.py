"""TLS on the HTTP and gRPC servers from ``listen.tls_cert_file`` / ``listen.tls_key_file``.

With both set, the balancer serves ``https://`` and a TLS gRPC port with the same certificate: a
client that trusts it is served, a plain-text client is not. A key that does not match the
certificate, or only one of the two settings, fails at start-up with a message naming the setting.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import grpc
import pytest
from certs import self_signed
from upstream_stub import MODEL, RecordingReplica, stub_settings

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.app import Balancer
from balancer.config import load
from balancer.errors import ConfigError
from balancer.tokenizer.tokenizer import TokenIdTokenizer

BODY = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1}


async def test_https_and_grpc_over_tls_and_nothing_in_plain_text(tmp_path: Path) -> None:
    pem = self_signed(tmp_path)
    replica = RecordingReplica("stub-0")
    await replica.start()
    settings = stub_settings(
        [replica],
        listen__grpc_port=0,
        listen__tls_cert_file=str(pem.cert),
        listen__tls_key_file=str(pem.key),
    )
    balancer = Balancer(settings, tokenizers={MODEL: TokenIdTokenizer()})
    try:
        await balancer.start()
        assert balancer.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(pem.cert))
        async with aiohttp.ClientSession() as session:
            async with session.post(balancer.url + "/v1/completions", json=BODY, ssl=trusted) as response:
                assert response.status == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(balancer.url + "/healthz")  # not trusted by the system CAs
            plain = balancer.url.replace("https://", "http://")
            with pytest.raises(aiohttp.ClientError):
                async with session.get(plain + "/healthz") as response:
                    await response.read()
        target = f"localhost:{balancer.grpc_port}"
        credentials = grpc.ssl_channel_credentials(root_certificates=pem.cert.read_bytes())
        async with grpc.aio.secure_channel(target, credentials) as channel:
            policy = await pb_grpc.AdminStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=10)
            assert policy.name == "cost"
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.AdminStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await balancer.stop()
        await replica.stop()


async def test_a_key_that_does_not_match_fails_at_start_naming_the_setting(tmp_path: Path) -> None:
    one, other = self_signed(tmp_path, "one"), self_signed(tmp_path, "other")
    settings = stub_settings([], listen__tls_cert_file=str(one.cert), listen__tls_key_file=str(other.key))
    with pytest.raises(ConfigError, match=r"listen\.tls_cert_file"):
        await Balancer(settings, tokenizers={}).start()
    missing = stub_settings(
        [], listen__tls_cert_file=str(tmp_path / "no.crt"), listen__tls_key_file=str(one.key)
    )
    with pytest.raises(ConfigError, match="cannot load"):
        await Balancer(missing, tokenizers={}).start()


def test_cert_and_key_go_together() -> None:
    with pytest.raises(ConfigError, match="set together"):
        load(env={}, sets=["listen.tls_cert_file=/etc/kvlb/tls.crt"])
