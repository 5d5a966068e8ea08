"""The rendered tcp overlay, run as pods would run it.

From `kubectl kustomize k8s/overlays/tcp`, the three etcd members, the router and one
prefill and one decode worker start with exactly the command, args, environment
(ConfigMap envFrom + env, $(VAR) expansion, downward API: metadata.name and status.podIP
become the pod's name and its namespace's address), volumes (the kvxfer-etcd-tls Secret,
made by the documented make-certs.sh, with its items, mode and fsGroup) and user
(runAsUser/runAsGroup/fsGroup, no capabilities, no_new_privs) the manifests give them,
each in its own network, PID and mount namespace (tests/support/deploy_pods.py). etcd
therefore runs with client and peer TLS and client-certificate authentication, and the
router and workers reach it over https with their client certificate.

What stands in for the cluster: /etc/hosts in each pod maps the Service names
(kvxfer-etcd-client -> member 0, kvxfer-etcd-N.kvxfer-etcd -> member N); binaries come
from this machine (.venv for the kvxfer image's /opt/kvxfer, Debian's etcd 3.4 for the
etcd image); resource limits and NetworkPolicies are not enforced (the policies are
checked statically in test_manifests.py).

Checked: every container port listens; startup, readiness and liveness probes answer as
specified (from a separate "kubelet" namespace, within timeoutSeconds); a completion with a
prompt long enough to be disaggregated (KV pushed prefill -> decode over libfabric tcp
between two namespaces) returns text through the router; then each pod's preStop runs in
the pod, SIGTERM goes to its PID 1, and it must exit within terminationGracePeriodSeconds.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from support.deploy_pods import (Pod, PodNetwork, can_run_pods, expand, materialize_volumes,
                                 start_pod)
from support.deploy_render import (K8S, container_env, main_container, named, pod_spec,
                                   prestop_sleep_s, rendered)

REASON = can_run_pods()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.timeout(180)]

VENV_BIN = str(Path(sys.executable).parent)
#: The image's ENV (Dockerfile): /opt/kvxfer/bin is this machine's .venv/bin.
IMAGE_ENV = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
START_BUDGET_S = 60.0
#: A test-side cap on the wait for an exit (well below the 150-330 s grace periods): the
#: assertion is "exits within terminationGracePeriodSeconds", this only bounds a hang.
EXIT_WAIT_CAP_S = 45.0
#: How long the kubelet namespace's connect to a declared container port may take.
PORT_CONNECT_TIMEOUT_S = 2
#: Longer than the router's disaggregation threshold (32 tokens), so prefill runs on the
#: prefill pod and its KV crosses to the decode pod over the fabric.
PROMPT = "The rendered manifests run as pods: this prompt is long enough to be disaggregated."


def _env_of(objects: list[dict[str, Any]], container: dict[str, Any], pod_name: str,
            pod_ip: str) -> dict[str, str]:
    env = dict(IMAGE_ENV, HOSTNAME=pod_name)
    for name, value in container_env(objects, container).items():
        if isinstance(value, dict):  # valueFrom: the downward API fields we use
            field = value["fieldRef"]["fieldPath"]
            value = {"metadata.name": pod_name, "status.podIP": pod_ip,
                     "metadata.namespace": "kvxfer"}[field]
        env[name] = expand(str(value), env)
    return env


def _port(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = rendered("overlays/tcp")
        self.net = PodNetwork()
        self.kubelet_ns, _ = self.net.add("kubelet")
        self.pods: dict[str, Pod] = {}
        self.certs = root / "certs"
        self.cluster_key = root / "cluster-key"

    def make_certs(self) -> None:
        subprocess.run([str(K8S / "components/etcd/in-cluster/make-certs.sh"), str(self.certs),
                        "kvxfer"], check=True, capture_output=True, timeout=60)
        # The kvxfer-cluster-key Secret, made as k8s/README.md says.
        self.cluster_key.mkdir()
        (self.cluster_key / "cluster.key").write_bytes(base64.b64encode(os.urandom(48)))

    def plan(self, name: str, owner: dict[str, Any]) -> None:
        ns, ip = self.net.add(name)
        container = main_container(owner)
        env = _env_of(self.objects, container, name, ip)
        argv = [expand(a, env) for a in container.get("command", ["kvxfer"]) + container.get("args", [])]
        self.pods[name] = Pod(name=name, ns=ns, ip=ip, container=container, env=env, argv=argv,
                              grace_s=pod_spec(owner).get("terminationGracePeriodSeconds", 30),
                              log_path=self.root / f"{name}.log", owner=owner)

    def hosts(self) -> str:
        lines = ["127.0.0.1 localhost"]
        for name, pod in self.pods.items():
            lines.append(f"{pod.ip} {name}" + (f" {name}.kvxfer-etcd" if name.startswith("kvxfer-etcd-") else ""))
        lines.append(f"{self.pods['kvxfer-etcd-0'].ip} kvxfer-etcd-client")  # the Service's VIP
        return "\n".join(lines) + "\n"

    def start(self, name: str) -> None:
        pod = self.pods[name]
        owner = pod.owner
        spec = pod_spec(owner)
        claims = {c["metadata"]["name"] for c in owner["spec"].get("volumeClaimTemplates", [])}
        root = self.root / name
        mounts = materialize_volumes(spec, pod.container, root, {"kvxfer-etcd-tls": self.certs,
                                                                 "kvxfer-cluster-key": self.cluster_key},
                                     claims, spec.get("securityContext", {}).get("fsGroup"))
        start_pod(self.net, pod, spec, root, self.hosts(), mounts)

    def http_status(self, pod: Pod, probe: dict[str, Any]) -> int:
        get = probe["httpGet"]
        url = f"http://{pod.ip}:{_port(pod.container, get['port'])}{get['path']}"
        timeout = probe.get("timeoutSeconds", 1)
        out = self.net.run(self.kubelet_ns, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                             "--max-time", str(timeout), url], timeout_s=timeout + 5)
        return int(out.stdout or 0)

    def wait_probe(self, pod: Pod, kind: str, deadline: float) -> float:
        """Polls the probe at its period until it succeeds (200-399); seconds it took."""
        probe = pod.container[kind]
        started = time.monotonic()
        while True:
            if 200 <= self.http_status(pod, probe) < 400:
                return time.monotonic() - started
            assert pod.alive(), f"{pod.name} exited while waiting for {kind}:\n{pod.log()}"
            assert time.monotonic() < deadline, f"{pod.name}: {kind} never succeeded:\n{pod.log()}"
            time.sleep(min(probe.get("periodSeconds", 10), 0.5))

    def logs(self) -> str:
        return "\n".join(f"----- {n} -----\n{p.log()}" for n, p in self.pods.items())

    def close(self) -> None:
        for pod in self.pods.values():
            pod.kill()
        self.net.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def _stop(cluster: Cluster, pod: Pod, results: dict[str, Any]) -> None:
    """The kubelet's pod termination: preStop hook (exec), then SIGTERM to PID 1."""
    started = time.monotonic()
    try:
        lifecycle = pod.container.get("lifecycle", {})
        if "preStop" in lifecycle:
            hook = lifecycle["preStop"]["exec"]["command"]
            out = pod.exec_in(hook, timeout_s=prestop_sleep_s(pod.container) + 10)
            assert out.returncode == 0, out.stderr
        os.kill(pod.pid1(), signal.SIGTERM)
        pod.proc.wait(timeout=min(pod.grace_s, EXIT_WAIT_CAP_S) - (time.monotonic() - started))
        results[pod.name] = time.monotonic() - started
    except Exception as exc:  # reported by the test thread
        results[pod.name] = exc


def test_tcp_overlay_runs_as_pods(cluster: Cluster) -> None:
    t0 = time.monotonic()
    objects = cluster.objects
    etcd = named(objects, "StatefulSet", "kvxfer-etcd")
    for i in range(etcd["spec"]["replicas"]):
        cluster.plan(f"kvxfer-etcd-{i}", etcd)
    for role in ("router", "prefill", "decode"):
        cluster.plan(f"kvxfer-{role}-0", named(objects, "Deployment", f"kvxfer-{role}"))
    cluster.make_certs()
    deadline = time.monotonic() + START_BUDGET_S
    try:
        # Everything starts at once, as after `kubectl apply`, except that the router
        # waits for etcd: it exits when etcd is unreachable at start-up, and the test has
        # no kubelet to restart it (workers register only after loading their model,
        # seconds after etcd is up).
        etcd_pods = [p for n, p in cluster.pods.items() if n.startswith("kvxfer-etcd-")]
        app_pods = [p for n, p in cluster.pods.items() if not n.startswith("kvxfer-etcd-")]
        for pod in etcd_pods + app_pods[1:]:
            cluster.start(pod.name)
        for pod in etcd_pods:
            cluster.wait_probe(pod, "readinessProbe", deadline)
        cluster.start(app_pods[0].name)
        for pod in app_pods:
            container = pod.container
            if "startupProbe" in container:
                probe = container["startupProbe"]
                took = cluster.wait_probe(pod, "startupProbe", deadline)
                assert took <= probe["periodSeconds"] * probe["failureThreshold"], pod.name
            cluster.wait_probe(pod, "livenessProbe", deadline)
        # Readiness: workers once registered in etcd (over TLS), the router once it sees a pair.
        for pod in app_pods + etcd_pods:
            cluster.wait_probe(pod, "readinessProbe", deadline)
            assert 200 <= cluster.http_status(pod, pod.container["livenessProbe"]) < 400
            # Every declared container port accepts connections: bash's /dev/tcp connects and
            # returns at once (curl's telnet:// held each connection until its --max-time).
            for port in pod.container["ports"]:
                out = cluster.net.run(cluster.kubelet_ns, [
                    "timeout", str(PORT_CONNECT_TIMEOUT_S), "bash", "-c",
                    f"exec 3<>/dev/tcp/{pod.ip}/{port['containerPort']}"], timeout_s=PORT_CONNECT_TIMEOUT_S + 8)
                assert out.returncode == 0, (pod.name, port, out.returncode, out.stderr)
        print(f"all pods ready after {time.monotonic() - t0:.1f} s")
        for pod in cluster.pods.values():
            uid, _, caps = pod.process_ids()
            print(f"{pod.name}: uid {uid}, CapEff {caps} {pod.note}")
            assert uid == pod.uid and int(caps, 16) == 0, pod.name

        # One completion through the router, from a client namespace.
        router = cluster.pods["kvxfer-router-0"]
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8})
        out = cluster.net.run(cluster.kubelet_ns, [
            "curl", "-s", "--max-time", "60", "-H", "content-type: application/json",
            "-d", body, f"http://{router.ip}:{_port(router.container, 'http')}/v1/completions"],
            timeout_s=70)
        answer = json.loads(out.stdout)
        assert answer["choices"][0]["text"], answer
        prefill_metrics = cluster.net.run(cluster.kubelet_ns, [
            "curl", "-s", "--max-time", "5",
            f"http://{cluster.pods['kvxfer-prefill-0'].ip}:8100/metrics"], timeout_s=10).stdout
        pushed = [line for line in prefill_metrics.splitlines()
                  if line.startswith("kvxfer_prefill_kv_pushed_bytes_total")]
        assert pushed and float(pushed[0].split()[-1]) > 0, "the KV did not cross the fabric"
        # The router's calls carried the cluster key's token; a client in another namespace
        # without it is refused by the worker, and sees no inventory on the router's port.
        decode = cluster.pods["kvxfer-decode-0"]
        refused = cluster.net.run(cluster.kubelet_ns, [
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", "-H",
            "content-type: application/json", "-d", '{"request_id": "x", "prompt_tokens": [1], "max_tokens": 1}',
            f"http://{decode.ip}:8200/reserve"], timeout_s=10).stdout
        listed = cluster.net.run(cluster.kubelet_ns, [
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
            f"http://{router.ip}:{_port(router.container, 'http')}/workers"], timeout_s=10).stdout
        assert (refused, listed) == ("401", "404")

        # Termination: app pods together (preStop, SIGTERM, drain), then etcd.
        for group in (app_pods, etcd_pods):
            results: dict[str, Any] = {}
            threads = [threading.Thread(target=_stop, args=(cluster, p, results)) for p in group]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(EXIT_WAIT_CAP_S + 20)
            for pod in group:
                took = results.get(pod.name)
                assert isinstance(took, float), f"{pod.name}: {took!r}\n{pod.log()}"
                assert took <= pod.grace_s and not pod.alive(), pod.name
            print("stopped: " + ", ".join(f"{n} {t:.1f} s" for n, t in results.items() if isinstance(t, float)))
        print(f"done after {time.monotonic() - t0:.1f} s")
    except BaseException:
        print(cluster.logs())
        raise
