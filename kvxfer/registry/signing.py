"""Registry records signed with the cluster key, so only kvxfer processes can add workers.

Anyone who can write to etcd (a leaked client certificate, a misconfigured RBAC, a pod
that reaches it) could otherwise register a fake worker: the router would send it user
prompts and relay its forged text. With a cluster key, a worker stores its record inside
an envelope that carries an HMAC-SHA256 over the etcd key and the record's exact bytes;
the watcher admits only records whose tag verifies. Binding the key into the tag stops a
genuine record from being replayed under another worker's key.

Envelope (the etcd value): ``{"v": 1, "record": "<record JSON as a string>", "sig": "<hex>"}``.
The record travels as a string so the tag covers its bytes, with no canonical form to
agree on. The cluster key is a file of at least 32 random bytes (a Kubernetes Secret);
the same file keys the control-plane tokens, through a different derived key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from kvxfer.errors import RegistryError

ENVELOPE_VERSION = 1
#: Shortest cluster key accepted: an HMAC key shorter than its 32-byte output wastes strength.
MIN_CLUSTER_KEY_BYTES = 32


class RecordRejected(RegistryError):
    """A registry value that is not a record signed by the cluster key; `reason` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


def load_cluster_key(path: str | os.PathLike[str]) -> bytes:
    """Reads the cluster key file (a path as str or Path); refuses keys too short to be safe."""
    key_path = Path(path)
    key = key_path.read_bytes().strip()
    if len(key) < MIN_CLUSTER_KEY_BYTES:
        raise RegistryError(f"cluster key {key_path} holds {len(key)} bytes; at least {MIN_CLUSTER_KEY_BYTES} are "
                            f"needed (e.g. `head -c 48 /dev/urandom | base64 > {key_path}`)")
    return key


def derive_key(cluster_key: bytes, purpose: str) -> bytes:
    """One key per purpose ("registry", "control"), so a tag for one is never valid for the other."""
    return hmac.new(cluster_key, b"kvxfer/" + purpose.encode(), hashlib.sha256).digest()


def vllm_api_key(cluster_key: bytes) -> str:
    """The API key of every vLLM instance of a cluster (vLLM's `VLLM_API_KEY`, sent as
    `Authorization: Bearer`), derived from the cluster key, so the router and the instances
    share it without another secret to distribute. vLLM checks it on every /v1 path.
    Unlike the control tokens it is a static bearer key: TLS or NetworkPolicies keep it off
    the wire where others listen (docs/architecture.md, "Threat model")."""
    if not isinstance(cluster_key, bytes):
        raise TypeError(f"vllm_api_key takes the cluster key's bytes (load_cluster_key(path)), not "
                        f"{type(cluster_key).__name__}")
    return derive_key(cluster_key, "vllm-api").hex()


def checksum_table_key(cluster_key: bytes) -> bytes:
    """The key that tags a push's KV checksum table (`kv.protocol.encode_mailbox`,
    `mailbox_tag_verifies`), derived from the cluster key: every worker derives it and no
    message carries it, so whoever steals a reservation (its descriptors, nonce and
    immediate) still cannot tag a table for forged pages (docs/architecture.md, "Threat model")."""
    return derive_key(cluster_key, "kv-table")


def checksum_table_key_of(cluster_key_file: str | os.PathLike[str] | None) -> bytes | None:
    """`checksum_table_key` of the cluster key in `cluster_key_file`; None without one
    (`--insecure`: tables go untagged)."""
    return checksum_table_key(load_cluster_key(cluster_key_file)) if cluster_key_file else None


def vllm_api_headers(api_key: str | None) -> dict[str, str]:
    """The header that presents `api_key` to a vLLM instance (none for an open instance)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class RecordSigner:
    """Seals records for etcd and opens them again, with the registry key of one cluster."""

    def __init__(self, cluster_key: bytes) -> None:
        self._key = derive_key(cluster_key, "registry")

    def _tag(self, etcd_key: str, record_json: str) -> str:
        message = etcd_key.encode() + b"\n" + record_json.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def seal(self, etcd_key: str, record_json: str) -> str:
        """The etcd value for `record_json` stored under `etcd_key`."""
        return json.dumps({"v": ENVELOPE_VERSION, "record": record_json, "sig": self._tag(etcd_key, record_json)})

    def open(self, etcd_key: str, value: bytes) -> str:
        """The record JSON inside a value written by `seal`; RecordRejected otherwise."""
        try:
            envelope = json.loads(value)
        except (ValueError, RecursionError):
            raise RecordRejected("unsigned", f"{etcd_key}: value is not a signed envelope") from None
        if not isinstance(envelope, dict) or "sig" not in envelope or "record" not in envelope:
            raise RecordRejected("unsigned", f"{etcd_key}: record carries no signature")
        if envelope.get("v") != ENVELOPE_VERSION:
            raise RecordRejected("bad_signature", f"{etcd_key}: unknown envelope version {envelope.get('v')!r}")
        record, sig = envelope["record"], envelope["sig"]
        if not isinstance(record, str) or not isinstance(sig, str):
            raise RecordRejected("bad_signature", f"{etcd_key}: malformed envelope")
        if not hmac.compare_digest(sig, self._tag(etcd_key, record)):
            raise RecordRejected("bad_signature", f"{etcd_key}: signature does not verify with the cluster key")
        return record
