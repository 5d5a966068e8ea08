"""Run rendered pod templates as local processes the way a kubelet would, for tests.

Each "pod" gets its own network namespace (`ip netns`) with one veth (eth0) into a bridge
that lives in a separate namespace of its own, so no address or link is added to the
host's namespaces, plus its own PID and mount namespaces (`unshare --pid --fork
--mount-proc` inside `ip netns exec`): the container command is PID 1 and gets SIGTERM
like in a pod. Inside the mount namespace the pod's volumes are bind-mounted at their
mountPaths (a private overlay over the parent directory supplies mount points that do not
exist on the host), /etc/hosts plays cluster DNS, and the process drops to the pod's
runAsUser/runAsGroup/fsGroup with no_new_privs and no capabilities (setpriv).

The network and the namespaces come from tests/support/pod_namespaces.py (shared with the
KV-path and cluster tests that run workers as pods). Needs root, iproute2, setpriv, curl.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from support import pod_namespaces
from support.pod_namespaces import IP, NSENTER, UNSHARE, PodNetwork, pod_pid1

__all__ = ["IP", "NSENTER", "UNSHARE", "Pod", "PodNetwork", "can_run_pods", "expand", "materialize_volumes",
           "start_pod"]


def can_run_pods() -> Optional[str]:
    """None when this machine can run the manifests' pods here, else the reason it cannot."""
    reason = pod_namespaces.can_run_pods()
    if reason is not None:
        return reason
    for tool in ("setpriv", "curl"):
        if not shutil.which(tool):
            return f"missing tool {tool}"
    return None


@dataclass
class Pod:
    """One pod: its namespace, address, the process running PID 1 (via unshare)."""

    name: str
    ns: str
    ip: str
    container: dict[str, Any]
    env: dict[str, str]
    argv: list[str]
    grace_s: int
    log_path: Path
    proc: Optional[subprocess.Popen[bytes]] = None
    owner: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    uid: int = 0

    def pid1(self, timeout_s: float = 10.0) -> int:
        """Host PID of the pod's PID 1 (the child that unshare forked)."""
        assert self.proc is not None
        try:
            return pod_pid1(self.proc, timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: {exc}:\n{self.log()}") from exc

    def process_ids(self) -> tuple[int, int, str]:
        """(uid, gid, effective capabilities) of the running PID 1, from /proc."""
        status = Path(f"/proc/{self.pid1()}/status").read_text()
        field = lambda key: re.search(rf"^{key}:\s+(\S+)", status, re.M).group(1)  # noqa: E731
        return int(field("Uid")), int(field("Gid")), field("CapEff")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def exec_in(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run argv in the pod's network, PID and mount namespaces (a preStop exec hook)."""
        return subprocess.run([NSENTER, "-t", str(self.pid1()), "-n", "-p", "-m", "--", *argv],
                              capture_output=True, text=True, timeout=timeout_s,
                              env=self.env)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # unshare --kill-child takes PID 1
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known variables are replaced, $$ escapes, others stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _mount_script(root: Path, mounts: list[tuple[Path, str, bool]], hosts: str,
                  security: dict[str, Any]) -> str:
    """Shell run as root inside the pod's fresh mount namespace before exec'ing PID 1."""
    lines = ["set -e", "mount --make-rprivate /"]
    # Mount points that do not exist on the host come from a private overlay over their
    # deepest existing ancestor (always /etc, which also carries the pod's hosts file).
    overlays = {Path("/etc")}
    for _, target, _ in mounts:
        path = Path(target)
        while not path.exists():
            path = path.parent
        if path != Path(target):
            assert path != Path("/"), f"cannot make mount point {target}"
            overlays.add(path)
    for index, lower in enumerate(sorted(overlays)):
        upper, work = root / f"overlay{index}" / "upper", root / f"overlay{index}" / "work"
        upper.mkdir(parents=True)
        work.mkdir(parents=True)
        if lower == Path("/etc"):
            (upper / "hosts").write_text(hosts)
        lines.append(f"mount -t overlay overlay -o lowerdir={lower},upperdir={upper},"
                     f"workdir={work} {lower}")
    for source, target, read_only in mounts:
        lines.append(f"mkdir -p {shlex.quote(target)}")
        lines.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
        if read_only:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
    # Then become the pod's user: runAsUser/runAsGroup, fsGroup as supplementary group,
    # no capabilities (drop ALL) and no_new_privs (allowPrivilegeEscalation: false).
    uid, gid = security.get("runAsUser", 0), security.get("runAsGroup", 0)
    groups = ",".join(str(g) for g in {gid, security.get("fsGroup", gid)})
    lines.append(f'exec setpriv --reuid={uid} --regid={gid} --groups={groups} '
                 f'--inh-caps=-all --bounding-set=-all --no-new-privs -- "$@"')
    return "\n".join(lines)


def materialize_volumes(spec: dict[str, Any], container: dict[str, Any], root: Path,
                        secrets: dict[str, Path], claim_names: set[str],
                        fs_group: Optional[int]) -> list[tuple[Path, str, bool]]:
    """Source directories for the container's volumeMounts, like the kubelet prepares them:
    Secret items with their mode and the fsGroup as group, fresh directories for claims."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = []
    for mount in container.get("volumeMounts", []):
        name = mount["name"]
        source = root / "volumes" / name
        source.mkdir(parents=True)
        if name in volumes and "secret" in volumes[name]:
            secret = volumes[name]["secret"]
            files = secrets[secret["secretName"]]
            items = secret.get("items") or [{"key": p.name, "path": p.name} for p in files.iterdir()]
            for item in items:
                target = source / item["path"]
                shutil.copyfile(files / item["key"], target)
                os.chmod(target, item.get("mode", secret.get("defaultMode", 0o644)))
                if fs_group is not None:
                    os.chown(target, 0, fs_group)
        elif name in claim_names or "emptyDir" in volumes.get(name, {}):
            if fs_group is not None:
                os.chown(source, 0, fs_group)
                os.chmod(source, 0o2770)
        else:
            raise AssertionError(f"volume {name}: kind not emulated here")
        mounts.append((source, mount["mountPath"], bool(mount.get("readOnly"))))
    return mounts


def _others_can_execute(program: str, path: str) -> bool:
    """Whether a uid that owns nothing here could exec `program` found on `path`."""
    found = shutil.which(program, path=path)
    if found is None:
        return False
    real = Path(os.path.realpath(found))
    dirs = [Path(p) for p in {str(found.rsplit("/", 1)[0])}] + list(real.parents)
    return bool(real.stat().st_mode & 0o001) and all(d.stat().st_mode & 0o001 for d in dirs)


def start_pod(net: PodNetwork, pod: Pod, spec: dict[str, Any], root: Path, hosts: str,
              mounts: list[tuple[Path, str, bool]]) -> None:
    security = dict(spec.get("securityContext", {}))
    security.update({k: v for k, v in pod.container.get("securityContext", {}).items()
                     if k in ("runAsUser", "runAsGroup")})
    if not _others_can_execute(pod.argv[0], pod.env.get("PATH", "")):
        # A test interpreter under /root (pyenv) is out of reach of the pod's uid; the
        # image's /opt/kvxfer is not. Stay uid 0 then, still without capabilities.
        pod.note = f"ran as uid 0: {pod.argv[0]} is not executable by uid {security.get('runAsUser')}"
        security = {"runAsUser": 0, "runAsGroup": 0}
    pod.uid = int(security.get("runAsUser", 0))
    script = _mount_script(root, mounts, hosts, security)
    log = open(pod.log_path, "wb")
    pod.proc = subprocess.Popen(
        [IP, "netns", "exec", pod.ns, UNSHARE, "--pid", "--fork", "--mount-proc", "--kill-child",
         "sh", "-c", script, pod.name, *pod.argv],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=pod.env,
        start_new_session=True)
    log.close()
