"""Processes as pods: each in its own network and PID namespace, joined by a bridge.

A `PodNetwork` makes a bridge inside a namespace of its own and, per pod, a network
namespace with one veth (eth0) whose peer sits on that bridge. Every link and address is
created inside namespaces this module made: nothing is added to the host's namespaces.
A pod's process runs as PID 1 of a fresh PID namespace (`pod_command`: `ip netns exec NS
unshare --pid --fork --mount-proc --kill-child ...`), so two pods differ in both network
and PID namespace, as two Kubernetes pods on one node do: the transfer engine's same-host
path (which needs the same PID namespace) cannot engage and the KV crosses the fabric.

The test process itself reaches the pods from a client namespace on the same bridge:
`with net.client(): ...` moves the calling thread (and the threads and processes it
starts meanwhile) into it, and back on exit.

Clean-up on every exit path: `close()` kills what still runs in each namespace and
deletes it; namespaces are named `kvxpod-<pid of the test process>-...`, and each new
`PodNetwork` first removes those whose test process is gone (a run killed by SIGKILL or a
timeout). Needs root and iproute2 (`can_run_pods()` says why not otherwise).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
#: Prefix of every namespace this module makes; what the sweep of leftovers looks for.
NS_PREFIX = "kvxpod-"
SUBNET = "10.213.77"
IP_COMMAND_TIMEOUT_S = 20.0
PID1_TIMEOUT_S = 10.0
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def can_run_pods() -> str | None:
    """None when this machine can run pods here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network and PID namespaces)"
    for tool in (IP, UNSHARE, NSENTER):
        if not Path(tool).exists():
            return f"missing tool {tool}"
    name = f"{NS_PREFIX}{os.getpid()}-probe"
    probe = subprocess.run([IP, "netns", "add", name], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` unavailable: {probe.stderr.strip()}"
    subprocess.run([IP, "netns", "del", name], check=False, capture_output=True)
    return None


def _ip(*args: str) -> str:
    out = subprocess.run([IP, *args], check=False, capture_output=True, text=True, timeout=IP_COMMAND_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _delete_namespace(ns: str) -> None:
    """SIGKILL whatever still runs in `ns`, then delete it."""
    pids = subprocess.run([IP, "netns", "pids", ns], check=False, capture_output=True, text=True,
                          timeout=IP_COMMAND_TIMEOUT_S).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run([IP, "netns", "del", ns], check=False, capture_output=True, timeout=IP_COMMAND_TIMEOUT_S)


def sweep_leftover_namespaces() -> list[str]:
    """Deletes `kvxpod-<pid>-*` namespaces whose test process is gone; returns their names."""
    swept = []
    for line in _ip("netns", "list").splitlines():
        ns = line.split()[0] if line.strip() else ""
        if not ns.startswith(NS_PREFIX):
            continue
        owner = ns[len(NS_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _delete_namespace(ns)
            swept.append(ns)
    return swept


def pod_command(ns: str, argv: list[str]) -> list[str]:
    """argv run as PID 1 of a new PID namespace (with its own /proc) inside network
    namespace `ns`; `--kill-child` takes PID 1 down when the unshare process dies."""
    return [IP, "netns", "exec", ns, UNSHARE, "--pid", "--fork", "--mount-proc", "--kill-child", *argv]


def pod_pid1(proc: subprocess.Popen[bytes], timeout_s: float = PID1_TIMEOUT_S) -> int:
    """Host PID of the PID 1 that `unshare` (started by `pod_command`) forked."""
    deadline = time.monotonic() + timeout_s
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    while True:
        try:
            found = children.read_text().split()
        except OSError:
            found = []
        if found:
            return int(found[0])
        if proc.poll() is not None:
            raise RuntimeError(f"pod process {proc.pid} exited with {proc.returncode} before its PID 1 showed")
        if time.monotonic() > deadline:
            raise RuntimeError(f"pod process {proc.pid}: no PID 1 after {timeout_s} s")
        time.sleep(0.02)


def signal_pod(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Delivers `sig` as the kubelet would: SIGKILL takes the whole pod (its process group);
    any other signal goes to PID 1 only (sent to `unshare` it would end the pod at once)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)
        else:
            os.kill(pod_pid1(proc), sig)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class PodNetwork:
    """A bridge in its own namespace and one namespace per pod, all removed by close()."""

    def __init__(self) -> None:
        sweep_leftover_namespaces()
        self.tag = f"{NS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.bridge_ns = f"{self.tag}-br"
        self.namespaces: list[str] = []
        self.addresses: dict[str, str] = {}
        self._next = 1
        self._client_ns: str | None = None
        try:
            _ip("netns", "add", self.bridge_ns)
            self.namespaces.append(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def add(self, name: str) -> tuple[str, str]:
        """A namespace for pod `name` on the bridge: (namespace, IP address)."""
        index = self._next
        self._next += 1
        ns, address, peer = f"{self.tag}-{index}", f"{SUBNET}.{index}", f"p{index}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        # Both ends are created inside namespaces: nothing appears in the host's.
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer,
            "netns", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", peer, "master", "br0")
        _ip("-n", self.bridge_ns, "link", "set", peer, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.addresses[name] = address
        return ns, address

    def run(self, ns: str, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """A short command inside namespace `ns` (a probe, a client request)."""
        return subprocess.run([IP, "netns", "exec", ns, *argv], check=False, capture_output=True, text=True,
                              timeout=timeout_s)

    @contextlib.contextmanager
    def client(self) -> Iterator[str]:
        """Moves the calling thread into the network's client namespace (made on first use)
        for the block: its sockets, and threads and processes started meanwhile, are on the
        bridge with the pods. Yields the client's address."""
        if self._client_ns is None:
            self._client_ns, _ = self.add("client")
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self._client_ns}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield self.addresses["client"]
            finally:
                _setns(own)
        finally:
            os.close(own)

    def close(self) -> None:
        """Kills every process left in the namespaces and deletes them."""
        for ns in reversed(self.namespaces):
            _delete_namespace(ns)
        self.namespaces.clear()
