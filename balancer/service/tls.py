"""TLS material for the HTTP and gRPC servers, from ``listen.tls_cert_file`` / ``tls_key_file`` (I/O:
reads the PEM files once at start-up).

Both servers use the same certificate chain and key. A missing or unreadable file, or a key that does
not match the certificate, is a :class:`ConfigError` naming the setting, raised before anything binds.
The HTTP side accepts TLS 1.2 and newer only.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from balancer.config import ListenConfig
from balancer.errors import ConfigError


def tls_enabled(listen: ListenConfig) -> bool:
    return listen.tls_cert_file is not None and listen.tls_key_file is not None


def server_ssl_context(listen: ListenConfig) -> ssl.SSLContext | None:
    """The HTTP server's context (``None``: plain text)."""
    if not tls_enabled(listen):
        return None
    assert listen.tls_cert_file is not None and listen.tls_key_file is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(listen.tls_cert_file, listen.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"listen.tls_cert_file / listen.tls_key_file: cannot load {listen.tls_cert_file} with "
            f"{listen.tls_key_file}: {exc.__class__.__name__}: {exc}"
        ) from None
    return context


def grpc_key_pair(listen: ListenConfig) -> tuple[bytes, bytes] | None:
    """``(private key PEM, certificate chain PEM)`` for ``grpc.ssl_server_credentials`` (``None``:
    plain text). The pair is checked by loading it into an SSL context first."""
    if server_ssl_context(listen) is None:
        return None
    assert listen.tls_cert_file is not None and listen.tls_key_file is not None
    return Path(listen.tls_key_file).read_bytes(), Path(listen.tls_cert_file).read_bytes()
