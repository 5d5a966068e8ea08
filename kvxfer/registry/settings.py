"""Registry settings: etcd endpoints, TLS files, credentials and the timeouts of every call."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

_log = logging.getLogger(__name__)


_DEFAULT_ETCD_PORT = 2379


def split_endpoint(url: str) -> tuple[str, int, bool]:
    """Parse ``http(s)://host[:port]`` into (host, port, secure)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"etcd endpoint {url!r} must look like http://HOST:PORT or https://HOST:PORT"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"etcd endpoint {url!r} must not have a path, query or fragment")
    try:
        port = parts.port or _DEFAULT_ETCD_PORT
    except ValueError as exc:
        raise ValueError(f"etcd endpoint {url!r} has an invalid port") from exc
    return parts.hostname, port, parts.scheme == "https"


class RegistrySettings(BaseModel):
    """How to reach etcd and how the registry behaves; every timeout carries its unit.

    `endpoints` lists the etcd members to use (a comma-separated string is accepted too);
    requests go to one member and fail over to the others when it stops answering. TLS
    is used for ``https://`` endpoints, with `tls_ca_path` (system roots when unset) and
    an optional client certificate (`tls_cert_path` + `tls_key_path`); `username` and
    `password` enable etcd authentication. Timeouts bound every blocking call: no etcd
    RPC waits longer than `request_timeout_s`, and `register` / `RegistryWatcher.start`
    give up after `connect_timeout_s`.
    """

    model_config = ConfigDict(extra="forbid")

    endpoints: list[str] = Field(default_factory=lambda: [f"http://127.0.0.1:{_DEFAULT_ETCD_PORT}"])
    prefix: str = "/kvxfer"
    # Integer because etcd leases are granted in whole seconds; etcd may raise very small
    # TTLs to its minimum (about 2 s for default election settings).
    lease_ttl_s: int = Field(default=5, ge=1)
    # None: a third of the granted TTL, so two keep-alives can be lost before expiry.
    keepalive_interval_s: float | None = Field(default=None, gt=0)
    # Load updates (free pages, queue depth) are written at most this often, last value
    # wins: a per-request write would turn etcd into the hot path.
    update_interval_s: float = Field(default=0.2, ge=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=2.0, gt=0)
    # Total time `revoke()` spends trying to delete the lease before leaving it to expire.
    revoke_timeout_s: float = Field(default=2.0, gt=0)
    retry_backoff_initial_s: float = Field(default=0.1, gt=0)
    retry_backoff_max_s: float = Field(default=2.0, gt=0)
    # After an endpoint fails, other endpoints are preferred for this long.
    endpoint_retry_after_s: float = Field(default=1.0, ge=0)
    # gRPC's default reconnect backoff grows to 120 s; capping it makes a restarted etcd
    # usable again within about this long.
    grpc_reconnect_backoff_max_s: float = Field(default=1.0, gt=0)
    # HTTP/2 pings detect a silently dead connection (partition) under a long-lived watch.
    # etcd rejects pings more often than every 5 s (--grpc-keepalive-min-time).
    grpc_keepalive_time_s: float = Field(default=10.0, ge=5.0)
    grpc_keepalive_timeout_s: float = Field(default=5.0, gt=0)
    tls_ca_path: Path | None = None
    tls_cert_path: Path | None = None
    tls_key_path: Path | None = None
    username: str | None = None
    password: SecretStr | None = None
    # The cluster key file (docs/architecture.md, "Registry (etcd)"): workers sign their
    # records with it and the watcher admits only records that verify. None: records are
    # neither signed nor checked, for local development only.
    cluster_key_path: Path | None = None

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split_comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one etcd endpoint is required")
        for url in value:
            split_endpoint(url)
        return value

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not value.startswith("/") or value.endswith("/") or len(value) < 2:
            raise ValueError(f"prefix {value!r} must start with '/' and not end with '/'")
        return value

    @model_validator(mode="after")
    def _check_tls_and_auth(self) -> "RegistrySettings":
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("tls_cert_path and tls_key_path must be given together")
        secure = {split_endpoint(url)[2] for url in self.endpoints}
        if len(secure) > 1:
            raise ValueError("etcd endpoints mix http:// and https://; use one scheme")
        uses_tls_files = any(
            p is not None for p in (self.tls_ca_path, self.tls_cert_path, self.tls_key_path)
        )
        if uses_tls_files and secure == {False}:
            raise ValueError("TLS files are set but the etcd endpoints are http://; use https://")
        for path in (self.tls_ca_path, self.tls_cert_path, self.tls_key_path):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        if self.cluster_key_path is not None and not self.cluster_key_path.is_file():
            raise ValueError(f"cluster key file {self.cluster_key_path} does not exist")
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password must be given together")
        if self.grpc_reconnect_backoff_max_s < 0.1:
            raise ValueError("grpc_reconnect_backoff_max_s must be at least 0.1")
        return self
