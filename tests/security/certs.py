"""Self-signed TLS material for tests, made with the ``openssl`` command (skips when it is missing)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def self_signed(directory: Path, name: str = "kvlb") -> Pem:
    """A certificate for ``localhost`` and ``127.0.0.1`` that is its own CA."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return Pem(cert, key)
