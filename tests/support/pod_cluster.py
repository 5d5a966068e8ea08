"""A whole deployment as pods: etcd, the router and every worker in a network and PID
namespace of its own (tests/support/pod_namespaces.py), on one bridge.

`PodCluster` is `kvxfer.cluster.local_cluster.LocalCluster` with its placement hooks
replaced: each process gets a pod address (fixed ports: every pod has its own network
stack), starts as PID 1 of its own PID namespace, and gets its signals as a kubelet sends
them (SIGTERM to PID 1, SIGKILL to the whole pod). Everything else, the arguments, the
environment (cluster key included) and the readiness wait, is LocalCluster's own, so the
two modes cannot drift apart.

The test process reaches the pods from the network's client namespace:

    with PodCluster(prefill=1, decode=1) as cluster, cluster.client():
        fire(cluster.router_url, ...)

`stop()` drains and stops the processes, then deletes every namespace.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxfer.cluster.local_cluster import LocalCluster
from kvxfer.cluster.local_etcd import LocalEtcd
from support.cluster_load import get_metrics, metric_value
from support.pod_namespaces import PodNetwork, can_run_pods, pod_command, signal_pod
from support.worker_procs import WorkerSet

#: None where this machine can run pods, else why not (then `pod_cluster` falls back).
POD_MODE_UNAVAILABLE = can_run_pods()
ROUTER_PORT = 8000
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380


class PodEtcd(LocalEtcd):
    """`LocalEtcd` in a pod of `net`: same data directory and restarts, pod address."""

    def __init__(self, net: PodNetwork, **kwargs: Any) -> None:
        self.ns, self.host = net.add("etcd")
        super().__init__(client_port=ETCD_CLIENT_PORT, peer_port=ETCD_PEER_PORT, **kwargs)

    def _command(self, binary: str) -> list[str]:
        return pod_command(self.ns, super()._command(binary))


class PodCluster(LocalCluster):
    """LocalCluster whose etcd, router and workers each run as a pod of one PodNetwork."""

    def __init__(self, **kwargs: Any) -> None:
        self.net = PodNetwork()
        self.pod_namespaces: dict[str, str] = {}
        try:
            super().__init__(router_port=ROUTER_PORT, **kwargs)
        except BaseException:
            self.net.close()
            raise

    def _address(self, name: str) -> str:
        if name not in self.pod_namespaces:
            self.pod_namespaces[name], _ = self.net.add(name)
        return self.net.addresses[name]

    def _new_etcd(self) -> LocalEtcd:
        return PodEtcd(self.net, log_path=self.log_dir / "etcd.log", client_cert_dir=self.etcd_cert_dir)

    def _signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        signal_pod(proc, sig)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self._address(name)
        return super()._spawn(name, pod_command(self.pod_namespaces[name], args), env)

    def client(self) -> contextlib.AbstractContextManager[str]:
        """The calling thread on the pods' bridge for the block (see PodNetwork.client)."""
        return self.net.client()

    def start(self) -> PodCluster:
        with self.client():
            super().start()
        return self

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        try:
            super().stop(drain_timeout_s)
        finally:
            self.net.close()


def kv_bytes_by_path(worker_url: str) -> dict[str, float]:
    """A worker's engine counters of posted bytes per path: `fabric` (rail 0, the only rail
    the tests' workers have) and `same_host`, plus the KV bytes the prefiller pushed."""
    text = get_metrics(worker_url)
    return {
        "fabric": metric_value(text, 'kvxfer_engine_posted_bytes_total{rail="0"}'),
        "same_host": metric_value(text, 'kvxfer_engine_posted_bytes_total{rail="same_host"}'),
        "kv_pushed": metric_value(text, "kvxfer_prefill_kv_pushed_bytes_total"),
    }


def assert_kv_crossed_fabric(prefill_urls: list[str]) -> dict[str, float]:
    """Every byte the prefillers pushed went over the fabric, none over the same-host path."""
    totals = {"fabric": 0.0, "same_host": 0.0, "kv_pushed": 0.0}
    for url in prefill_urls:
        for key, value in kv_bytes_by_path(url).items():
            totals[key] += value
    assert totals["kv_pushed"] > 0, f"no KV was pushed: {totals}"
    assert totals["same_host"] == 0, f"KV took the same-host path between pods: {totals}"
    assert totals["fabric"] >= totals["kv_pushed"], f"KV bytes missing from the fabric counters: {totals}"
    return totals


def pod_cluster(**kwargs: Any) -> LocalCluster:
    """A PodCluster; where namespaces cannot be made (`POD_MODE_UNAVAILABLE` says why), a
    LocalCluster on loopback with the same-host path off, so the KV still takes the fabric."""
    if POD_MODE_UNAVAILABLE is None:
        return PodCluster(**kwargs)
    worker_env = {**(kwargs.pop("worker_env", None) or {}), "KVXFER_SAME_HOST": "false"}
    return LocalCluster(worker_env=worker_env, **kwargs)


def client_of(cluster: LocalCluster) -> contextlib.AbstractContextManager[Any]:
    """The calling thread on `cluster`'s network for the block: a PodCluster's client
    namespace; nothing to enter on loopback."""
    return cluster.client() if isinstance(cluster, PodCluster) else contextlib.nullcontext()


@contextlib.contextmanager
def pod_worker_set(work_dir: Path, request: pytest.FixtureRequest, label: str) -> Iterator[WorkerSet]:
    """Workers as pods of one network (own network and PID namespace each), with the caller
    on the pods' bridge, so KV between them crosses the fabric. Where namespaces cannot be
    made: loopback with the same-host path off. Workers and the network are torn down at
    exit; the workers' logs are printed if a test failed meanwhile."""
    net = PodNetwork() if POD_MODE_UNAVAILABLE is None else None
    workers = WorkerSet(work_dir, pods=net, env={"KVXFER_SAME_HOST": "false"} if net is None else None)
    failed_before = request.session.testsfailed
    try:
        with net.client() if net is not None else contextlib.nullcontext():
            yield workers
    finally:
        if request.session.testsfailed > failed_before:
            print(f"\n===== worker logs ({label}) =====\n{workers.logs()}")
        workers.close()
        if net is not None:
            net.close()
