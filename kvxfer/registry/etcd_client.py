"""etcd plumbing shared by registration and watcher: connecting, error triage, backoff.

Each registry half owns one client used only by its own background thread: the client
keeps per-connection state (current endpoint, cached stubs) that is not safe to share.
"""

from __future__ import annotations

import logging

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exceptions

_log = logging.getLogger(__name__)

from kvxfer.registry.settings import RegistrySettings, split_endpoint

# Failures that mean "etcd did not answer": the client and its endpoint bookkeeping stay
# useful. Anything else (auth token rejected after an etcd restart, unexpected errors)
# gets a fresh client, which also re-authenticates.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
    etcd_exceptions.NoServerAvailableError,
    etcd_exceptions.WatchTimedOut,
)


def connect_etcd(settings: RegistrySettings) -> pyetcd.MultiEndpointEtcd3Client:
    """Build an etcd client over all endpoints, with bounded timeouts and failover.

    Raises whatever the client raises (authentication happens here when configured);
    callers treat that as one failed attempt.
    """
    credentials: grpc.ChannelCredentials | None = None
    secure = split_endpoint(settings.endpoints[0])[2]
    if secure:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=settings.tls_ca_path.read_bytes() if settings.tls_ca_path else None,
            private_key=settings.tls_key_path.read_bytes() if settings.tls_key_path else None,
            certificate_chain=settings.tls_cert_path.read_bytes() if settings.tls_cert_path else None,
        )
    options = [
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(settings.grpc_reconnect_backoff_max_s * 1000)),
        ("grpc.keepalive_time_ms", int(settings.grpc_keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.grpc_keepalive_timeout_s * 1000)),
        # Otherwise gRPC stops pinging an idle watch stream after two pings.
        ("grpc.http2.max_pings_without_data", 0),
    ]
    endpoints = []
    for url in settings.endpoints:
        host, port, _ = split_endpoint(url)
        endpoints.append(
            pyetcd.Endpoint(
                f"[{host}]" if ":" in host else host,
                port,
                secure=secure,
                creds=credentials,
                time_retry=settings.endpoint_retry_after_s,
                opts=options,
            )
        )
    try:
        client = pyetcd.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=settings.request_timeout_s,
            user=settings.username,
            password=settings.password.get_secret_value() if settings.password else None,
            failover=True,
        )
    except BaseException:
        for endpoint in endpoints:
            endpoint.close()
        raise
    if not secure:
        # The client sends the auth token twice: as plain metadata and as gRPC call
        # credentials; gRPC refuses call credentials on a plaintext channel (every call
        # fails UNAUTHENTICATED), while the metadata alone is what etcd reads.
        client.call_credentials = None
    return client


def describe_etcd_error(exc: BaseException) -> str:
    """One-line description of an etcd/gRPC failure for logs and error messages."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        details = exc.details() if hasattr(exc, "details") else ""
        return f"{exc.code().name}: {details}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_not_found(exc: BaseException) -> bool:
    """True for etcd's 'requested lease not found' (a put on an expired lease)."""
    return (
        isinstance(exc, grpc.RpcError)
        and hasattr(exc, "code")
        and exc.code() == grpc.StatusCode.NOT_FOUND
    )


class Backoff:
    """Exponential retry delay between `initial_s` and `max_s`; `reset()` after a success."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial_s = initial_s
        self._max_s = max(max_s, initial_s)
        self._next_s = initial_s
        self._etcd_answered = False

    def next_delay_s(self, etcd_answered: bool = False) -> float:
        """Delay before the next attempt; `etcd_answered` says the failure was an answer.

        An answer after a run of "no answer" failures means etcd is back (typically an
        auth token from before a restart was rejected), so the delay grown during the
        outage is dropped; repeated answers (a wrong password) still back off.
        """
        if etcd_answered and not self._etcd_answered:
            self._next_s = self._initial_s
        self._etcd_answered = etcd_answered
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self._max_s)
        return delay

    def reset(self) -> None:
        self._next_s = self._initial_s
        self._etcd_answered = False


# ----------------------------------------------------------------------- registration
