"""etcd peer registry: workers announce themselves under a lease, routers watch the prefix.

Contract (docs/architecture.md, "Registry (etcd)"): key
``{prefix}/workers/{role}/{worker_id}``, value a JSON `WorkerRecord`, attached to the
worker's lease (TTL 5 s by default). A worker that dies stops refreshing its lease and its
key disappears after the TTL; a worker that drains revokes the lease and its key
disappears at once.

- `settings`: endpoints, TLS, credentials and timeouts (`RegistrySettings`);
- `record`: the record and the key scheme (`WorkerRecord`, `worker_key`);
- `etcd_client`: connecting, error triage and backoff, shared by the two halves;
- `registration`: the worker half (`WorkerRegistration`);
- `watcher`: the router half (`RegistryWatcher`).

Imports only `kvxfer.errors` and etcd's client: the router uses it without the engine.
"""

from kvxfer.errors import RegistryError, RegistryTimeoutError
from kvxfer.registry.record import WorkerRecord, WorkerRole, worker_key, workers_prefix
from kvxfer.registry.registration import WorkerRegistration
from kvxfer.registry.settings import RegistrySettings
from kvxfer.registry.watcher import RegistryWatcher

__all__ = [
    "RegistryError",
    "RegistryTimeoutError",
    "RegistrySettings",
    "RegistryWatcher",
    "WorkerRecord",
    "WorkerRegistration",
    "WorkerRole",
    "worker_key",
    "workers_prefix",
]
