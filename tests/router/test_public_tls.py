"""The router's public port over HTTPS from certificate files (tls_cert_file, tls_key_file),
as a Kubernetes TLS Secret mounts them: a real router process, a certificate made here."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)

START_TIMEOUT_S = 60.0
OPENSSL = shutil.which("openssl")


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by openssl (no download)."""
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=kvxfer-router-test",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=30)
    return cert, key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(OPENSSL is None, reason="no openssl command to make a certificate with")
def test_the_public_port_serves_https_with_the_given_certificate_and_refuses_plain_http(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    workers = tmp_path / "workers.json"
    workers.write_text(json.dumps([]))
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer_router", "--host", "127.0.0.1", "--port", str(port), "--admin-port", "-1",
         "--workers-file", str(workers), "--tls-cert-file", str(cert), "--tls-key-file", str(key)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        verified = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                resp = httpx.get(f"https://127.0.0.1:{port}/health", verify=verified, trust_env=False, timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()
                assert time.monotonic() < deadline, "router did not serve HTTPS in time"
                time.sleep(0.2)
        assert resp.status_code == 200
        # The certificate served is the one from the files.
        served = ssl.get_server_certificate(("127.0.0.1", port))
        assert ssl.PEM_cert_to_DER_cert(served) == ssl.PEM_cert_to_DER_cert(cert.read_text())
        # Plain HTTP on the same port gets no answer it could use.
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def test_a_certificate_without_its_key_is_refused_at_start() -> None:
    from kvxfer_router.settings import RouterSettings

    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        RouterSettings(tls_cert_file=Path("/tmp/x.crt"))
