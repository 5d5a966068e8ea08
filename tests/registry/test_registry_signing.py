"""Only kvxfer can add a worker: with a cluster key, the watcher admits only records that
carry a valid signature over their key, and nothing admits a record without a lease.

Against a real etcd. The attacker here has full write access to etcd (a raw client), as
in the measured attack: a fake worker put with `etcdctl put` was listed 0.05 s later and
got 20 of 21 user requests.
"""

from __future__ import annotations

import base64
import secrets
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyetcd
import pytest

from kvxfer.cluster.local_etcd import LocalEtcd
from kvxfer.errors import RegistryError
from kvxfer.registry import RegistrySettings, RegistryWatcher, WorkerRecord, WorkerRegistration, worker_key
from kvxfer.registry.signing import RecordRejected, RecordSigner, load_cluster_key
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
LEASE_TTL_S = 2
SETTLE_S = 0.5  # a watcher has applied an event well within this on loopback


def record(worker_id: str, role: str = "decode") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, role=role, http_url="http://127.0.0.1:8200", engine_address="0a0b",
                        model="tiny", kv_layout="L2-H2-D16-float32-bs16", total_pages=64, free_pages=64)


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.key"
    path.write_bytes(base64.b64encode(secrets.token_bytes(48)))
    return path


@pytest.fixture
def settings(etcd: LocalEtcd, key_file: Path) -> RegistrySettings:
    return RegistrySettings(endpoints=[etcd.client_url], prefix=f"/kvxfer-sig-{uuid.uuid4().hex[:10]}",
                            lease_ttl_s=LEASE_TTL_S, cluster_key_path=key_file)


@pytest.fixture
def raw(etcd: LocalEtcd) -> Iterator[pyetcd.Etcd3Client]:
    client = pyetcd.client(host="127.0.0.1", port=int(etcd.client_url.rsplit(":", 1)[1]), timeout=2)
    yield client
    client.close()


def test_a_signed_registration_is_admitted(settings: RegistrySettings) -> None:
    registration = WorkerRegistration(settings)
    try:
        registration.register(record("genuine"))
        with RegistryWatcher(settings) as watcher:
            wait_until(lambda: [w.worker_id for w in watcher.workers()] == ["genuine"], 5, "the genuine worker")
            assert watcher.rejected_records() == {}
    finally:
        registration.revoke()


def test_a_fake_worker_written_straight_to_etcd_is_ignored_and_counted(
        settings: RegistrySettings, raw: pyetcd.Etcd3Client) -> None:
    registration = WorkerRegistration(settings)
    try:
        registration.register(record("genuine"))
        with RegistryWatcher(settings) as watcher:
            wait_until(lambda: watcher.workers(), 5, "the genuine worker")
            lease = raw.lease(30)
            # 1. a plain record, as `etcdctl put` would write it
            raw.put(worker_key(settings.prefix, "decode", "fake-plain"), record("fake-plain").model_dump_json(),
                    lease=lease)
            # 2. an envelope with a made-up signature
            forged = RecordSigner(b"not the cluster key".ljust(32, b"!"))
            raw.put(worker_key(settings.prefix, "decode", "fake-forged"),
                    forged.seal(worker_key(settings.prefix, "decode", "fake-forged"),
                                record("fake-forged").model_dump_json()), lease=lease)
            # 3. the genuine worker's own signed value, replayed under another key
            genuine_value = raw.get(worker_key(settings.prefix, "decode", "genuine"))[0]
            raw.put(worker_key(settings.prefix, "decode", "genuine2"), genuine_value, lease=lease)
            wait_until(lambda: sum(watcher.rejected_records().values()) >= 3, 5, "three rejections")
            time.sleep(SETTLE_S)
            assert [w.worker_id for w in watcher.workers()] == ["genuine"]
            assert watcher.rejected_records() == {"unsigned": 1, "bad_signature": 2}
            lease.revoke()
    finally:
        registration.revoke()


def test_a_record_without_a_lease_is_never_admitted_even_without_a_key(
        etcd: LocalEtcd, raw: pyetcd.Etcd3Client) -> None:
    # A leaseless record would stay routable for ever after its worker died.
    unkeyed = RegistrySettings(endpoints=[etcd.client_url], prefix=f"/kvxfer-sig-{uuid.uuid4().hex[:10]}")
    raw.put(worker_key(unkeyed.prefix, "prefill", "immortal"), record("immortal", "prefill").model_dump_json())
    with RegistryWatcher(unkeyed) as watcher:
        time.sleep(SETTLE_S)
        assert watcher.workers() == []
        assert watcher.rejected_records() == {"no_lease": 1}


def test_seal_and_open_bind_the_record_to_its_key() -> None:
    signer = RecordSigner(b"k" * 32)
    value = signer.seal("/p/workers/decode/a", '{"x": 1}')
    assert signer.open("/p/workers/decode/a", value.encode()) == '{"x": 1}'
    with pytest.raises(RecordRejected) as moved:
        signer.open("/p/workers/decode/b", value.encode())
    assert moved.value.reason == "bad_signature"
    tampered = value.replace('{\\"x\\": 1}', '{\\"x\\": 2}')
    assert tampered != value
    with pytest.raises(RecordRejected):
        signer.open("/p/workers/decode/a", tampered.encode())


def test_a_short_cluster_key_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_bytes(b"too short")
    with pytest.raises(RegistryError, match="at least 32"):
        load_cluster_key(short)
