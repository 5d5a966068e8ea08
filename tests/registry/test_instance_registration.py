"""A vLLM instance's registration (kvxfer.integrations.vllm.instance_registration) against a
real etcd: it keeps trying to register while etcd is away at start-up, a stop() during
those attempts leaves nothing behind, and the load noted while not registered is in the
record written when it registers again.

The instance's own OpenAI API is stood in for by a tiny HTTP server that answers
`/v1/models`, which is all `start()` asks of it before registering (no warm-up: 0 tokens).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyetcd
import pytest

from kvxfer.cluster.local_etcd import LocalEtcd, _free_loopback_port
from kvxfer.integrations.vllm.instance_registration import InstanceRegistration
from kvxfer.integrations.vllm.settings import ConnectorSettings
from kvxfer.registry import RegistrySettings, worker_key
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

LEASE_TTL_S = 2  # etcd's minimum with default election settings; keeps the gap short
_DEFAULTS = RegistrySettings()
#: Once etcd answers, the next attempt comes within one backoff step (at most
#: retry_backoff_max_s), gRPC reconnects within grpc_reconnect_backoff_max_s, and an attempt
#: still in flight against the dead server ends within request_timeout_s; 1 s of slack.
REGISTERED_AFTER_ETCD_UP_WITHIN_S = (_DEFAULTS.retry_backoff_max_s + _DEFAULTS.grpc_reconnect_backoff_max_s
                                     + _DEFAULTS.request_timeout_s + 1.0)
#: stop() during the attempts: the one RPC in flight (request_timeout_s) and the revoke
#: (revoke_timeout_s, not needed when no lease was granted) bound it; 1 s of slack.
STOPPED_WITHIN_S = _DEFAULTS.request_timeout_s + 1.0
#: How long the instance fails against a dead etcd before the test brings etcd up: past
#: connect_timeout_s, after which the registration used to give up for good.
ETCD_DOWN_AT_START_FOR_S = _DEFAULTS.connect_timeout_s + 1.0
#: How long the test lets the instance fail before stopping it: several attempts, past the
#: first backoff steps.
FAILING_FOR_S = 1.0
#: After FAILING_FOR_S of failures an attempt that outlived stop() would get through this
#: soon once etcd is up: its next backoff step (at most retry_backoff_max_s) plus gRPC's
#: reconnect (grpc_reconnect_backoff_max_s).
LATE_ATTEMPT_WITHIN_S = _DEFAULTS.retry_backoff_max_s + _DEFAULTS.grpc_reconnect_backoff_max_s
#: start() polls the instance's API every 0.5 s; a registration against a running etcd
#: takes milliseconds: 1.5 s covers both with slack.
API_POLL_AND_REGISTER_S = 1.5
SETTLED_WITHIN_S = 10.0  # anything else: a registration against a running etcd, a lost lease noticed


# ---------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Geometry:
    num_heads: int


class _Region:
    """What InstanceRegistration reads of a KVRegion: its layout string and block count."""

    geometry = _Geometry(num_heads=2)
    num_blocks = 64

    def instance_kv_layout(self, total_kv_heads: int) -> str:
        return f"L2-H{total_kv_heads}-D16-float32-bs16"


class _ModelsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"object": "list", "data": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass


@contextmanager
def serving_models_api(port: int = 0) -> Iterator[str]:
    """The instance's OpenAI API on 127.0.0.1:`port` (0: any free one), answering
    /v1/models at once; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _ModelsHandler)
    thread = threading.Thread(target=server.serve_forever, name="fake-openai-api", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


@pytest.fixture
def api_url() -> Iterator[str]:
    with serving_models_api() as url:
        yield url


@pytest.fixture
def prefix() -> str:
    return f"/kvxfer-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def instances() -> Iterator[list[InstanceRegistration]]:
    """Registrations created by a test; all stopped at teardown."""
    created: list[InstanceRegistration] = []
    yield created
    for instance in created:
        instance.stop()


def make_instance(etcd_url: str, prefix: str, api_url: str, created: list[InstanceRegistration]
                  ) -> InstanceRegistration:
    settings = ConnectorSettings(etcd=etcd_url, etcd_prefix=prefix, lease_ttl_s=LEASE_TTL_S, advertise_url=api_url,
                                 insecure=True, worker_id="vllm-decode-0", registration_wait_s=SETTLED_WITHIN_S)
    instance = InstanceRegistration(settings, "kv_consumer", "tiny", "0a0b0c", _Region(),  # type: ignore[arg-type]
                                    warmup_prompt_tokens=0, kv_heads=2)
    created.append(instance)
    return instance


def key(prefix: str) -> str:
    return worker_key(prefix, "decode", "vllm-decode-0")


def stored(etcd_url: str, prefix: str) -> dict[str, Any] | None:
    """The record under the instance's key as etcd has it (None: no key)."""
    port = int(etcd_url.rsplit(":", 1)[1])
    with pyetcd.client(host="127.0.0.1", port=port, timeout=2) as client:
        value, _ = client.get(key(prefix))
    return None if value is None else json.loads(value)


def lines(caplog: pytest.LogCaptureFixture, prefix: str, level: str) -> list[str]:
    """Log lines of `level` that name this test's key (threads of other tests may still log)."""
    return [r.getMessage() for r in caplog.records if r.levelname == level and key(prefix) in r.getMessage()]


def stopped_etcd(tmp_path: Path) -> tuple[LocalEtcd, str]:
    """A LocalEtcd not yet running and its client URL, on a port chosen now so clients can
    be pointed at it before it starts; its data lives in tmp_path, so stop() + start()
    keeps it."""
    port = _free_loopback_port()
    return LocalEtcd(client_port=port, data_dir=tmp_path / "etcd"), f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------------- tests


def test_instance_started_while_etcd_is_down_registers_once_etcd_is_up(
    tmp_path: Path, prefix: str, api_url: str, instances: list[InstanceRegistration],
    caplog: pytest.LogCaptureFixture,
) -> None:
    etcd, etcd_url = stopped_etcd(tmp_path)
    instance = make_instance(etcd_url, prefix, api_url, instances)
    try:
        with caplog.at_level("DEBUG", logger="kvxfer"):
            caplog.clear()  # from here on: the registration's own lines
            instance.start()
            time.sleep(ETCD_DOWN_AT_START_FOR_S)

            etcd.start()
            up_at = time.monotonic()
            record = wait_until(lambda: stored(etcd_url, prefix), REGISTERED_AFTER_ETCD_UP_WITHIN_S,
                                "the instance's record once etcd is up")
            registered_after_s = time.monotonic() - up_at
            # The registry logs right after the put the test just saw.
            wait_until(lambda: lines(caplog, prefix, "INFO"), SETTLED_WITHIN_S, "the 'registered' line")
        assert record["http_url"] == api_url and record["engine"] == "vllm"
        assert registered_after_s < REGISTERED_AFTER_ETCD_UP_WITHIN_S
        # One warning when it started failing, one info when it got through; the retries
        # in between log at debug only.
        warnings = lines(caplog, prefix, "WARNING")
        assert len(warnings) == 1 and "unreachable" in warnings[0], warnings
        infos = lines(caplog, prefix, "INFO")
        assert len(infos) == 1 and "registered" in infos[0] and "s of failures" in infos[0], infos
    finally:
        instance.stop()
        etcd.stop()


def test_stop_during_the_attempts_returns_promptly_and_leaves_no_record(
    tmp_path: Path, prefix: str, api_url: str, instances: list[InstanceRegistration],
) -> None:
    etcd, etcd_url = stopped_etcd(tmp_path)
    instance = make_instance(etcd_url, prefix, api_url, instances)
    try:
        instance.start()
        time.sleep(FAILING_FOR_S)  # retrying against the dead etcd

        started = time.monotonic()
        instance.stop()
        stop_took_s = time.monotonic() - started
        assert stop_took_s < STOPPED_WITHIN_S

        # Nothing registers after the stop, even with etcd up for longer than an attempt
        # would take to get through.
        etcd.start()
        time.sleep(LATE_ATTEMPT_WITHIN_S)
        assert stored(etcd_url, prefix) is None
    finally:
        etcd.stop()


def test_stop_while_waiting_for_the_api_leaves_no_record_once_the_api_answers(
    prefix: str, instances: list[InstanceRegistration],
) -> None:
    with LocalEtcd() as etcd:
        api_port = _free_loopback_port()
        instance = make_instance(etcd.client_url, prefix, f"http://127.0.0.1:{api_port}", instances)
        instance.start()  # the API does not answer yet: vLLM still loading
        instance.stop()

        with serving_models_api(api_port):
            time.sleep(API_POLL_AND_REGISTER_S)
            assert stored(etcd.client_url, prefix) is None


def test_load_noted_while_etcd_was_away_is_in_the_record_after_registering_again(
    tmp_path: Path, prefix: str, api_url: str, instances: list[InstanceRegistration],
) -> None:
    etcd, etcd_url = stopped_etcd(tmp_path)
    etcd.start()
    instance = make_instance(etcd_url, prefix, api_url, instances)
    try:
        instance.start()
        wait_until(lambda: stored(etcd_url, prefix), SETTLED_WITHIN_S, "the first registration")
        instance.note_load(1)
        wait_until(lambda: (stored(etcd_url, prefix) or {}).get("running") == 1, SETTLED_WITHIN_S,
                   "running=1 in the record")

        etcd.stop()
        # The next keep-alive fails: the instance knows it is not registered.
        wait_until(lambda: not instance.is_registered, SETTLED_WITHIN_S, "the registration lost")
        instance.note_load(3)

        etcd.start()
        wait_until(lambda: instance.is_registered, REGISTERED_AFTER_ETCD_UP_WITHIN_S + LEASE_TTL_S,
                   "registered again")
        # No note_load since: the record written on registering again carries the load.
        wait_until(lambda: (stored(etcd_url, prefix) or {}).get("running") == 3, SETTLED_WITHIN_S,
                   "running=3, noted during the gap, in the record")
    finally:
        instance.stop()
        etcd.stop()
