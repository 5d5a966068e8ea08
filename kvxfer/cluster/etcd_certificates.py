"""Certificates that close a local etcd to anonymous clients: a one-run CA, etcd's own
certificate and the one client certificate kvxfer's processes present.

`kvxfer up` runs etcd with ``--client-cert-auth`` (as the Kubernetes manifests do,
k8s/components/etcd/in-cluster/make-certs.sh): only a client holding a certificate signed
by this run's CA gets past the TLS handshake, for reads, writes and leases alike. The CA's
key signs the two certificates and is deleted at once, so nothing can mint another one;
the files sit in a folder only their owner may open (0700, files 0600). Made with the
`openssl` command (Debian's openssl package), which every machine that has etcd has.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvxfer.errors import KvxferError

__all__ = ["EtcdCertificateError", "EtcdClientTls", "EtcdServerTls", "make_etcd_certificates"]

# One openssl run makes one key or signs one certificate: milliseconds; the bound is for a
# machine so loaded that the run would otherwise hang `kvxfer up` without a word.
_OPENSSL_TIMEOUT_S = 30.0
# The files live only as long as their run (`kvxfer up` deletes them at stop) and the CA
# key is gone after signing, so a long validity costs nothing and a long-running
# deployment never meets an expired certificate.
_VALIDITY_DAYS = 3650


class EtcdCertificateError(KvxferError, RuntimeError):
    """Raised when the certificates cannot be made; the message quotes openssl's error."""


@dataclass(frozen=True)
class EtcdClientTls:
    """What a client presents to the local etcd: the CA that verifies the server, and the
    client certificate with its key."""

    ca_path: Path
    cert_path: Path
    key_path: Path


@dataclass(frozen=True)
class EtcdServerTls:
    """etcd's side: the CA that verifies clients and peers, etcd's certificate and key
    (used for its client and peer ports both), and the client files kvxfer hands out."""

    ca_path: Path
    cert_path: Path
    key_path: Path
    client: EtcdClientTls


def _openssl(directory: Path, *args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise EtcdCertificateError("the openssl command is not on PATH; install Debian's openssl package")
    try:
        # umask 077: keys are never readable by others, not even between creation and chmod.
        done = subprocess.run([binary, *args], cwd=directory, capture_output=True, text=True,
                              timeout=_OPENSSL_TIMEOUT_S, umask=0o077, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise EtcdCertificateError(f"openssl {args[0]} did not finish within {_OPENSSL_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        raise EtcdCertificateError(f"openssl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


def _san(host: str) -> str:
    names = {"127.0.0.1", host}
    entries = []
    for name in sorted(names):
        try:
            ipaddress.ip_address(name)
            entries.append(f"IP:{name}")
        except ValueError:
            entries.append(f"DNS:{name}")
    return ",".join(["DNS:localhost", *entries])


def make_etcd_certificates(directory: Path, host: str) -> EtcdServerTls:
    """Make a CA, etcd's certificate (valid for `host`, 127.0.0.1 and localhost) and a
    client certificate in `directory`, created or tightened to 0700, every file 0600.

    The CA key is deleted once both certificates are signed. Raises
    `EtcdCertificateError` when openssl is missing or fails.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ec_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    days = ("-days", str(_VALIDITY_DAYS))
    _openssl(directory, "req", "-x509", "-new", *ec_key, "-keyout", "ca.key", "-out", "ca.crt", *days,
             "-subj", "/CN=kvxfer-local-etcd-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    leaf = ("-addext", "basicConstraints=critical,CA:FALSE",
            "-addext", "keyUsage=critical,digitalSignature,keyEncipherment")
    # etcd's certificate serves the client and peer ports and is also the client
    # certificate its own gRPC gateway dials the client port with, hence clientAuth too.
    _openssl(directory, "req", "-x509", "-new", *ec_key, "-CA", "ca.crt", "-CAkey", "ca.key",
             "-keyout", "server.key", "-out", "server.crt", *days, "-subj", "/CN=kvxfer-local-etcd", *leaf,
             "-addext", "extendedKeyUsage=serverAuth,clientAuth", "-addext", f"subjectAltName={_san(host)}")
    _openssl(directory, "req", "-x509", "-new", *ec_key, "-CA", "ca.crt", "-CAkey", "ca.key",
             "-keyout", "client.key", "-out", "client.crt", *days, "-subj", "/CN=kvxfer", *leaf,
             "-addext", "extendedKeyUsage=clientAuth")
    (directory / "ca.key").unlink()
    for path in directory.iterdir():
        os.chmod(path, 0o600)
    return EtcdServerTls(
        ca_path=directory / "ca.crt", cert_path=directory / "server.crt", key_path=directory / "server.key",
        client=EtcdClientTls(ca_path=directory / "ca.crt", cert_path=directory / "client.crt",
                             key_path=directory / "client.key"),
    )
