"""Registry behaviour against a real etcd (kvxfer.cluster.local_etcd.LocalEtcd).

Every test uses its own key prefix, so tests sharing an etcd never see each other's
workers. Waits are bounded by generous deadlines; the only tight one is the contract's
"a registered worker is visible within 1 s".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyetcd
import pytest
from pydantic import SecretStr, ValidationError

from kvxfer.cluster.local_etcd import LocalEtcd, LocalEtcdError, _free_loopback_port
from kvxfer.registry import (
    RegistryError,
    RegistrySettings,
    RegistryTimeoutError,
    RegistryWatcher,
    WorkerRecord,
    WorkerRegistration,
    worker_key,
)
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL_S = 2  # etcd's minimum with default election settings; keeps expiry tests short
VISIBLE_WITHIN_S = 1.0  # the contract: a registration shows up at routers within 1 s
RECOVERY_WITHIN_S = 15.0  # generous bound for anything that crosses an etcd restart


# ---------------------------------------------------------------------------- helpers


def make_record(worker_id: str, role: str = "decode", **fields: object) -> WorkerRecord:
    values: dict[str, object] = {
        "worker_id": worker_id,
        "role": role,
        "http_url": "http://127.0.0.1:8200",
        "engine_address": "0a0b0c",
        "model": "tiny-seeded",
        "kv_layout": "L2-H2-D16-float32-bs16",
        "total_pages": 64,
        "free_pages": 64,
    }
    values.update(fields)
    return WorkerRecord.model_validate(values)



def ids(workers: list[WorkerRecord]) -> list[str]:
    return [w.worker_id for w in workers]


def raw_client(etcd: LocalEtcd) -> pyetcd.Etcd3Client:
    port = int(etcd.client_url.rsplit(":", 1)[1])
    return pyetcd.client(host="127.0.0.1", port=port, timeout=2)


def dead_url() -> str:
    return f"http://127.0.0.1:{_free_loopback_port()}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def restartable_etcd() -> Iterator[LocalEtcd]:
    """A second server for tests that restart etcd, so the others are not disturbed."""
    with LocalEtcd() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"/kvxfer-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def settings(etcd: LocalEtcd, prefix: str) -> RegistrySettings:
    return RegistrySettings(endpoints=[etcd.client_url], prefix=prefix, lease_ttl_s=LEASE_TTL_S)


@pytest.fixture
def registrations() -> Iterator[list[WorkerRegistration]]:
    """Registrations created by a test; all revoked at teardown."""
    created: list[WorkerRegistration] = []
    yield created
    for registration in created:
        registration.revoke()


def register(
    settings: RegistrySettings, record: WorkerRecord, created: list[WorkerRegistration]
) -> WorkerRegistration:
    registration = WorkerRegistration(settings)
    created.append(registration)
    registration.register(record)
    return registration


@pytest.fixture
def watcher(settings: RegistrySettings) -> Iterator[RegistryWatcher]:
    with RegistryWatcher(settings) as started:
        yield started


# ------------------------------------------------------------------ basic lifecycle


def test_registered_worker_is_visible_to_watcher_within_one_second(
    settings: RegistrySettings, watcher: RegistryWatcher, registrations: list[WorkerRegistration]
) -> None:
    record = make_record("decode-0")

    registration = register(settings, record, registrations)

    workers = watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], VISIBLE_WITHIN_S)
    assert workers[0].model_dump(exclude={"updated_at"}) == record.model_dump(exclude={"updated_at"})
    assert workers[0].updated_at > 0
    assert registration.is_registered
    assert registration.key == f"{settings.prefix}/workers/decode/decode-0"
    assert watcher.get("decode", "decode-0") == workers[0]


def test_watcher_started_late_lists_existing_workers_and_reports_them_as_added(
    settings: RegistrySettings, registrations: list[WorkerRegistration]
) -> None:
    register(settings, make_record("prefill-0", role="prefill"), registrations)
    register(settings, make_record("decode-0"), registrations)
    added: list[str] = []

    with RegistryWatcher(settings, on_add=lambda r: added.append(r.worker_id)) as watcher:
        assert watcher.is_synced
        assert ids(watcher.workers()) == ["decode-0", "prefill-0"]
        assert ids(watcher.workers(role="prefill")) == ["prefill-0"]
        assert sorted(added) == ["decode-0", "prefill-0"]


def test_update_is_visible_to_watcher(
    settings: RegistrySettings, watcher: RegistryWatcher, registrations: list[WorkerRegistration]
) -> None:
    registration = register(settings, make_record("decode-0", free_pages=64), registrations)

    registration.update(free_pages=10, queue_depth=3, running=2, draining=True)

    watcher.wait_for(
        lambda ws: len(ws) == 1
        and (ws[0].free_pages, ws[0].queue_depth, ws[0].running, ws[0].draining) == (10, 3, 2, True),
        timeout_s=5.0,
    )


def test_burst_of_updates_is_coalesced_and_last_value_wins(
    settings: RegistrySettings, registrations: list[WorkerRegistration]
) -> None:
    updates_seen: list[int] = []
    with RegistryWatcher(settings, on_update=lambda r: updates_seen.append(r.free_pages)) as watcher:
        registration = register(settings, make_record("decode-0", free_pages=1000), registrations)
        watcher.wait_for(lambda ws: len(ws) == 1, VISIBLE_WITHIN_S)

        for free_pages in range(999, 499, -1):  # 500 updates, as from 500 requests
            registration.update(free_pages=free_pages)

        watcher.wait_for(lambda ws: ws[0].free_pages == 500, timeout_s=5.0)
    # Writes are spaced by update_interval_s (0.2 s), so a burst costs a handful of them.
    assert updates_seen[-1] == 500
    assert len(updates_seen) < 20, updates_seen


def test_revoke_removes_worker_at_once(
    settings: RegistrySettings, registrations: list[WorkerRegistration]
) -> None:
    removed: list[str] = []
    with RegistryWatcher(settings, on_remove=lambda r: removed.append(r.worker_id)) as watcher:
        registration = register(settings, make_record("decode-0"), registrations)
        watcher.wait_for(lambda ws: len(ws) == 1, VISIBLE_WITHIN_S)

        assert registration.revoke() is True

        watcher.wait_for(lambda ws: ws == [], VISIBLE_WITHIN_S)  # well before the TTL
        assert removed == ["decode-0"]
        assert not registration.is_registered
        assert registration.lease_id is None


def test_worker_process_killed_without_revoke_disappears_after_lease_ttl(
    settings: RegistrySettings, watcher: RegistryWatcher
) -> None:
    script = (
        "import sys, time\n"
        "from kvxfer.registry import RegistrySettings, WorkerRecord, WorkerRegistration\n"
        "registration = WorkerRegistration(RegistrySettings.model_validate_json(sys.argv[1]))\n"
        "registration.register(WorkerRecord.model_validate_json(sys.argv[2]))\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    worker = subprocess.Popen(
        [sys.executable, "-c", script, settings.model_dump_json(), make_record("doomed").model_dump_json()],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        watcher.wait_for(lambda ws: ids(ws) == ["doomed"], timeout_s=20.0)  # includes imports
        # Alive and keeping its lease: still there after more than one TTL.
        time.sleep(LEASE_TTL_S + 0.5)
        assert ids(watcher.workers()) == ["doomed"]

        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=5.0)

        watcher.wait_for(lambda ws: ws == [], timeout_s=LEASE_TTL_S + 5.0)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=5.0)


# --------------------------------------------------------------- etcd failure modes


def test_etcd_restart_keeps_worker_registered_and_watcher_follows_later_changes(
    restartable_etcd: LocalEtcd, prefix: str, registrations: list[WorkerRegistration]
) -> None:
    settings = RegistrySettings(endpoints=[restartable_etcd.client_url], prefix=prefix, lease_ttl_s=LEASE_TTL_S)
    with RegistryWatcher(settings) as watcher:
        registration = register(settings, make_record("decode-0", free_pages=64), registrations)
        watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], VISIBLE_WITHIN_S)

        restartable_etcd.restart()

        wait_until(lambda: watcher.is_synced and registration.is_registered, RECOVERY_WITHIN_S,
                   "watcher re-sync and registration recovery")
        assert ids(watcher.workers()) == ["decode-0"]
        # Changes after the restart reach the watcher: its watch was re-established.
        registration.update(free_pages=7)
        watcher.wait_for(lambda ws: len(ws) == 1 and ws[0].free_pages == 7, RECOVERY_WITHIN_S)
        register(settings, make_record("decode-1"), registrations)
        watcher.wait_for(lambda ws: ids(ws) == ["decode-0", "decode-1"], VISIBLE_WITHIN_S)


def test_etcd_replaced_by_empty_cluster_gets_worker_back_under_new_lease(
    restartable_etcd: LocalEtcd, prefix: str, registrations: list[WorkerRegistration]
) -> None:
    settings = RegistrySettings(endpoints=[restartable_etcd.client_url], prefix=prefix, lease_ttl_s=LEASE_TTL_S)
    with RegistryWatcher(settings) as watcher:
        registration = register(settings, make_record("decode-0"), registrations)
        watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], VISIBLE_WITHIN_S)

        restartable_etcd.restart(wipe_data=True)  # keys, leases and revisions are gone

        wait_until(lambda: watcher.is_synced and registration.is_registered, RECOVERY_WITHIN_S,
                   "recovery after etcd lost its data")
        watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], RECOVERY_WITHIN_S)
        value, meta = raw_client(restartable_etcd).get(registration.key)
        assert value is not None and meta.lease_id == registration.lease_id


def test_lease_lost_while_running_is_replaced_by_a_new_lease(
    etcd: LocalEtcd, settings: RegistrySettings, watcher: RegistryWatcher,
    registrations: list[WorkerRegistration],
) -> None:
    registration = register(settings, make_record("decode-0"), registrations)
    watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], VISIBLE_WITHIN_S)
    old_lease_id = registration.lease_id
    assert old_lease_id is not None

    # As if the lease expired during a partition: the key goes with it.
    raw_client(etcd).revoke_lease(old_lease_id)

    wait_until(lambda: registration.lease_id not in (None, old_lease_id) and registration.is_registered,
               RECOVERY_WITHIN_S, "a new lease")
    watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], RECOVERY_WITHIN_S)
    _, meta = raw_client(etcd).get(registration.key)
    assert meta.lease_id == registration.lease_id


def test_several_endpoints_with_the_first_one_dead_still_work(
    etcd: LocalEtcd, prefix: str, registrations: list[WorkerRegistration]
) -> None:
    settings = RegistrySettings(endpoints=[dead_url(), etcd.client_url], prefix=prefix, lease_ttl_s=LEASE_TTL_S)

    with RegistryWatcher(settings) as watcher:
        # Several registrations, so the dead endpoint is almost surely tried by some client.
        for index in range(3):
            register(settings, make_record(f"decode-{index}"), registrations)
        watcher.wait_for(lambda ws: ids(ws) == ["decode-0", "decode-1", "decode-2"], 5.0)
        registrations[0].update(free_pages=1)
        watcher.wait_for(lambda ws: ws[0].free_pages == 1, 5.0)


def test_register_fails_with_clear_error_when_no_etcd_answers(prefix: str) -> None:
    url = dead_url()
    settings = RegistrySettings(endpoints=[url], prefix=prefix, connect_timeout_s=0.5)
    registration = WorkerRegistration(settings)

    with pytest.raises(RegistryTimeoutError, match="could not register") as excinfo:
        registration.register(make_record("decode-0"))
    assert url in str(excinfo.value)
    assert not registration.is_registered

    with pytest.raises(RegistryTimeoutError, match=url):
        RegistryWatcher(settings).start()


def test_malformed_records_are_skipped_with_a_warning(
    etcd: LocalEtcd, settings: RegistrySettings, registrations: list[WorkerRegistration],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = raw_client(etcd)
    workers = f"{settings.prefix}/workers"
    client.put(f"{workers}/decode/not-json", b"{not json")
    client.put(f"{workers}/decode/missing-fields", b'{"worker_id": "missing-fields"}')
    client.put(f"{workers}/decode/wrong-id", make_record("other-id").model_dump_json())
    client.put(f"{workers}/router/odd-role", b"{}")
    register(settings, make_record("good-0"), registrations)

    with caplog.at_level(logging.WARNING, logger="kvxfer.registry"):
        with RegistryWatcher(settings) as watcher:
            assert ids(watcher.workers()) == ["good-0"]  # initial list skipped the rest

            # The watch path skips them too, and a record that turns bad is dropped.
            client.put(f"{workers}/decode/good-0", b"\xff\xfe garbage")
            client.put(f"{workers}/decode/nested/id", make_record("id").model_dump_json())
            register(settings, make_record("good-1"), registrations)
            watcher.wait_for(lambda ws: ids(ws) == ["good-1"], 5.0)
            assert watcher.is_synced

    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for key in ("not-json", "missing-fields", "wrong-id", "router/odd-role", "decode/good-0", "nested/id"):
        assert f"{workers}/{key}" in warned or key in warned, (key, warned)


def test_auth_enabled_etcd_restart_re_authenticates(prefix: str, registrations: list[WorkerRegistration]) -> None:
    with LocalEtcd() as server:
        etcdctl = ["etcdctl", f"--endpoints={server.client_url}"]
        env = {**os.environ, "ETCDCTL_API": "3"}
        for args in (["user", "add", "root:s3cret"], ["auth", "enable"]):
            subprocess.run(etcdctl + args, env=env, check=True, capture_output=True, timeout=10)
        settings = RegistrySettings(
            endpoints=[server.client_url], prefix=prefix, lease_ttl_s=LEASE_TTL_S,
            username="root", password=SecretStr("s3cret"),
        )
        with RegistryWatcher(settings) as watcher:
            registration = register(settings, make_record("decode-0"), registrations)
            watcher.wait_for(lambda ws: ids(ws) == ["decode-0"], VISIBLE_WITHIN_S)

            server.restart()  # tokens issued before the restart are no longer valid

            wait_until(lambda: watcher.is_synced and registration.is_registered, RECOVERY_WITHIN_S,
                       "recovery with re-authentication")
            registration.update(free_pages=3)
            watcher.wait_for(lambda ws: len(ws) == 1 and ws[0].free_pages == 3, RECOVERY_WITHIN_S)
        assert registration.revoke() is True


# ----------------------------------------------------------------- API validation


def test_update_rejects_unknown_fields_identity_changes_and_invalid_values(
    settings: RegistrySettings, registrations: list[WorkerRegistration]
) -> None:
    registration = WorkerRegistration(settings)
    with pytest.raises(RegistryError, match="register"):
        registration.update(free_pages=1)

    registration = register(settings, make_record("decode-0"), registrations)
    with pytest.raises(RegistryError, match="unknown WorkerRecord fields"):
        registration.update(free_page=1)
    with pytest.raises(RegistryError, match="move the key"):
        registration.update(role="prefill")
    with pytest.raises(RegistryError, match="invalid update"):
        registration.update(free_pages=-1)
    assert registration.record is not None and registration.record.free_pages == 64
    with pytest.raises(RegistryError, match="already registered"):
        registration.register(make_record("decode-0"))


def test_settings_validate_endpoints_prefix_and_tls_up_front(tmp_path: Path) -> None:
    settings = RegistrySettings.model_validate({"endpoints": "http://127.0.0.1:2379, http://127.0.0.1:22379"})
    assert settings.endpoints == ["http://127.0.0.1:2379", "http://127.0.0.1:22379"]
    assert settings.prefix == "/kvxfer" and settings.lease_ttl_s == 5

    with pytest.raises(ValidationError, match="must look like"):
        RegistrySettings(endpoints=["127.0.0.1:2379"])
    with pytest.raises(ValidationError, match="at least one"):
        RegistrySettings(endpoints=[])
    with pytest.raises(ValidationError, match="prefix"):
        RegistrySettings(prefix="kvxfer/")
    cert = tmp_path / "client.pem"
    cert.write_text("x")
    with pytest.raises(ValidationError, match="together"):
        RegistrySettings(endpoints=["https://127.0.0.1:2379"], tls_cert_path=cert)
    with pytest.raises(ValidationError, match="https"):
        RegistrySettings(tls_ca_path=cert)
    with pytest.raises(ValidationError, match="does not exist"):
        RegistrySettings(endpoints=["https://127.0.0.1:2379"], tls_ca_path=tmp_path / "missing.pem")
    with pytest.raises(ValidationError, match="together"):
        RegistrySettings(username="root")


def test_worker_key_follows_the_architecture_contract() -> None:
    assert worker_key("/kvxfer", "prefill", "p0") == "/kvxfer/workers/prefill/p0"
    with pytest.raises(ValidationError):
        make_record("has/slash")
    with pytest.raises(ValidationError):
        make_record("d0", engine_address="not-hex")


# ------------------------------------------------------------------------ LocalEtcd


def test_local_etcd_restart_keeps_url_and_data(restartable_etcd: LocalEtcd) -> None:
    url = restartable_etcd.client_url
    raw_client(restartable_etcd).put("/local-etcd-test/key", b"value")

    restartable_etcd.restart()

    assert restartable_etcd.client_url == url and restartable_etcd.is_running
    value, _ = raw_client(restartable_etcd).get("/local-etcd-test/key")
    assert value == b"value"


def test_local_etcd_stop_kills_the_server_and_removes_its_temp_dir() -> None:
    server = LocalEtcd().start()
    pid, data_dir = server.pid, server.data_dir
    assert pid is not None and data_dir.is_dir()

    server.stop()

    assert server.pid is None and not server.is_running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not data_dir.exists()


def test_local_etcd_without_binary_names_the_debian_package() -> None:
    with pytest.raises(LocalEtcdError, match="etcd-server"):
        LocalEtcd(etcd_binary="definitely-not-etcd-binary").start()
