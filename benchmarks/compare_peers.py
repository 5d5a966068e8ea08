#!/usr/bin/env python3
"""kvxfer side by side with Mooncake Transfer Engine and NVIDIA NIXL (issue 6).

Same workloads for every system, two processes on this machine over loopback, data
verified after every repeat:
  bulk-64k  1 GiB written as 64 KiB writes (64 in flight)      GB/s, initiator completion
  bulk-1m   1 GiB written as 1 MiB writes                       GB/s, initiator completion
  kv-4k     one Llama-3-8B-shaped request, 4K tokens: 32 layers x K,V x 512 pages of
            16 KiB to random destination pages                 GB/s, receiver completion
  kv-16k    the same for 16K tokens (2048 pages per layer and K|V, 2 GiB)
  lat-4k    4 KiB write latency, p50 / p99 in microseconds
Systems (each peer runs in its own virtual environment):
  kvxfer-{tcp,net,shm}-r{1,2}   kvxfer on libfabric provider tcp / net / shm, 1 or 2 rails
  kvxfer-net-r1-caller          kvxfer on net, 1 rail, progress driven by the initiator's calling
                                thread instead of a progress thread (progress="caller")
  kvxfer-samehost-r1            kvxfer's same-host path: the target's buffer is a SharedBuffer
                                (as kvxfer's KV cache is), mapped and written with memcpy;
                                immediates through the target's shared-memory ring
                                (KVXFER_SAME_HOST_IMM_RING=0 sends them over net)
  mooncake-tcp                  Mooncake TE, TCP transport, P2P handshake (no metadata server)
  nixl-ucx-tcp                  NIXL, UCX backend forced to TCP (UCX_TLS=tcp)
  nixl-ucx-default              NIXL, UCX backend with its default same-host transports
Limits measured in the same run: memcpy and one loopback TCP stream (machine_limits.py).

Each kvxfer row is compared with the best peer of its transport class: TCP-class
(kvxfer tcp/net, mooncake-tcp, nixl-ucx-tcp) and same-host (kvxfer shm and samehost,
nixl-ucx-default).
The goal for the engine is >= 1.5x on every workload.

Writes benchmarks/results/compare_peers.{json,png,md}, prints the table, and refreshes the
table between `<!-- compare_peers:begin -->` and `<!-- compare_peers:end -->` in the README
(--readme). Venvs live in .bench-venvs/<system> and are created on first use; NIXL is
installed only with --install-nixl (without its torch/CUDA dependencies, ~340 MB).
Examples:
  .venv/bin/python benchmarks/compare_peers.py --quick                 # smoke run, minutes
  .venv/bin/python benchmarks/compare_peers.py --install-nixl          # full run
  .venv/bin/python benchmarks/compare_peers.py --systems mooncake-tcp,kvxfer-net-r1 \\
      --workloads bulk-1m,kv-4k --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = HERE / "peers"
VENVS = ROOT / ".bench-venvs"
sys.path.insert(0, str(HERE))

import machine_limits  # noqa: E402

# Pinned so that a rerun measures the same code; override with --mooncake-spec/--nixl-spec.
MOONCAKE_SPEC = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# nixl pulls nixl-cu12 and nixl-cu13, which require torch (a CUDA build, GBs). The UCX
# backend on host memory needs neither torch nor CUDA, so it is installed without deps.
NIXL_SPEC = "nixl==1.5.1 nixl-cu12==1.5.1"
PIP_TIMEOUT_S = 900

TCP, SAME_HOST = "TCP", "same-host"

SYSTEMS: dict[str, dict[str, Any]] = {}
# kvxfer on each libfabric provider with its same-host path off, and its same-host path
# (memcpy into the target's SharedBuffer, immediates through its ring) as a system of its
# own in the same-host class.
# Rails only carry the same-host path's immediates, so it runs with one.
for _prov, _cls, _same_host, _rail_counts in (("tcp", TCP, "off", (1, 2)), ("net", TCP, "off", (1, 2)),
                                              ("shm", SAME_HOST, "off", (1, 2)),
                                              ("net", SAME_HOST, "on", (1,))):
    for _rails in _rail_counts:
        SYSTEMS[f"kvxfer-{'samehost' if _same_host == 'on' else _prov}-r{_rails}"] = {
            "kind": "kvxfer", "cls": _cls,
            "args": ["--provider", _prov, "--rails", str(_rails), "--same-host", _same_host],
            "env": {"KVXFER_BIND_HOST": "127.0.0.1"},
        }
# Caller-driven progress at the initiator (TransferEngine(progress="caller")): no thread
# hand-offs, for a thread that submits and waits.
SYSTEMS["kvxfer-net-r1-caller"] = {
    "kind": "kvxfer", "cls": TCP,
    "args": ["--provider", "net", "--rails", "1", "--same-host", "off", "--progress", "caller"],
    "env": {"KVXFER_BIND_HOST": "127.0.0.1"},
}
SYSTEMS["mooncake-tcp"] = {"kind": "mooncake", "cls": TCP, "args": [],
                           "env": {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}}
SYSTEMS["nixl-ucx-tcp"] = {"kind": "nixl", "cls": TCP, "args": [], "env": {"UCX_TLS": "tcp"}}
SYSTEMS["nixl-ucx-default"] = {"kind": "nixl", "cls": SAME_HOST, "args": [], "env": {},
                               "unset": ["UCX_TLS"]}
SYSTEM_GROUPS = {
    "all": list(SYSTEMS),
    "kvxfer": [s for s in SYSTEMS if s.startswith("kvxfer")],
    "peers": [s for s in SYSTEMS if not s.startswith("kvxfer")],
    "mooncake": ["mooncake-tcp"],
    "nixl": ["nixl-ucx-tcp", "nixl-ucx-default"],
}
WORKLOADS = ["bulk-64k", "bulk-1m", "kv-4k", "kv-16k", "lat-4k"]
PEER_SCRIPT = {"kvxfer": "kvxfer_peer.py", "mooncake": "mooncake_peer.py", "nixl": "nixl_peer.py"}


class Skip(Exception):
    """A system that cannot run here (not built, not installed): shown, never fatal."""


# --------------------------------------------------------------------------------------
# Workload parameters
# --------------------------------------------------------------------------------------
def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def workload_params(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """CLI arguments of the peer programs for one workload, plus a human label."""
    if name.startswith("bulk"):
        ws = (64 << 10) if name == "bulk-64k" else (1 << 20)
        total = a.bulk_bytes
        return {"metric": "GB/s", "bytes": total,
                "label": f"bulk {fmt_bytes(total)} as {fmt_bytes(ws)} writes",
                "args": ["--workload", "bulk", "--total-bytes", str(total), "--write-size", str(ws),
                         "--depth", str(a.depth)]}
    if name.startswith("kv"):
        tokens = a.kv_tokens[0] if name == "kv-4k" else a.kv_tokens[1]
        pages = -(-tokens // (16384 // 2048))
        total = 32 * 2 * pages * 16384
        return {"metric": "GB/s", "bytes": total,
                "label": f"KV push {tokens} tok: 32 L x K,V x {pages} x 16 KiB ({fmt_bytes(total)})",
                "args": ["--workload", "kv", "--tokens", str(tokens), "--layers", "32",
                         "--page-size", "16384", "--kv-token-bytes", "2048"]}
    if name == "lat-4k":
        return {"metric": "us", "bytes": 4096, "label": f"4 KiB write latency ({a.lat_iters} samples/repeat)",
                "args": ["--workload", "lat", "--write-size", "4096", "--iters", str(a.lat_iters)]}
    raise ValueError(name)


# --------------------------------------------------------------------------------------
# Virtual environments
# --------------------------------------------------------------------------------------
def _pip(py: Path, args: list[str], log: Path) -> None:
    cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=PIP_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            raise Skip(f"pip install {' '.join(args)} took over {PIP_TIMEOUT_S} s (log: {log})") from None
    if rc:
        tail = [ln for ln in log.read_text().splitlines() if "Location 'file:" not in ln][-3:]
        raise Skip(f"pip install failed ({' | '.join(tail)[-300:]}); log: {log}")


def ensure_venv(kind: str, a: argparse.Namespace, log_dir: Path) -> Path:
    """Python of the system's environment, creating the venv on first use."""
    if kind == "kvxfer":
        py = Path(a.kvxfer_python).absolute()
        if not py.exists():
            raise Skip(f"no kvxfer python at {py} (run scripts/run setup)")
        probe = subprocess.run(
            [str(py), "-c", "import kvxfer._native, json, kvxfer.transfer.engine as e; "
                            "print(json.dumps(e.available_providers()))"],
            capture_output=True, text=True, timeout=120, cwd=str(PEERS),
        )
        if probe.returncode:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            raise Skip(f"kvxfer engine not built ({last[:160]})")
        return py
    spec = {"mooncake": a.mooncake_spec, "nixl": a.nixl_spec}[kind]
    venv = VENVS / kind
    py = venv / "bin" / "python"
    marker = venv / ".compare_peers-installed"
    if marker.exists() and marker.read_text().strip() == spec and py.exists():
        return py
    if kind == "nixl" and not a.install_nixl:
        raise Skip("NIXL not installed: rerun with --install-nixl (about 340 MB, no torch/CUDA)")
    if a.no_install:
        raise Skip(f"{kind} venv missing and --no-install given")
    log = log_dir / f"venv-{kind}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    if venv.exists():
        shutil.rmtree(venv)
    r = subprocess.run([sys.executable if not a.base_python else a.base_python, "-m", "venv", str(venv)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise Skip(f"python -m venv failed: {r.stderr.strip()[-200:]}")
    if kind == "nixl":
        _pip(py, ["--no-deps", *spec.split()], log)
        _pip(py, ["numpy"], log)
    else:
        _pip(py, [*spec.split(), "numpy"], log)
    marker.write_text(spec + "\n")
    return py


# --------------------------------------------------------------------------------------
# One system x workload: a target and an initiator process
# --------------------------------------------------------------------------------------
def _kill_group(p: subprocess.Popen) -> None:
    """Stops a peer and anything it started (each peer leads its own process group)."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)  # also reaches helpers left behind by a leader that exited
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=grace)
            if sig == signal.SIGKILL:
                break
        except subprocess.TimeoutExpired:
            continue
    if p.poll() is None:
        p.wait(timeout=5)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _last_log_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Traceback" not in ln:
            return ln[-200:]
    return ""


def run_pair(system: str, wl_name: str, py: Path, a: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    spec = SYSTEMS[system]
    params = workload_params(wl_name, a)
    d = run_dir / f"{system}__{wl_name}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    # Deadlines: generous for a slow peer on a busy 2-core box, finite for a stuck one.
    reps = a.warmup + a.repeats
    step_s = 60.0 + params["bytes"] / 20e6
    pair_deadline = 90.0 + reps * (2 * step_s) if wl_name != "lat-4k" else 90.0 + reps * (a.lat_iters * 0.05 + 30)
    pair_deadline *= a.timeout_scale
    common = [*params["args"], "--repeats", str(a.repeats), "--warmup", str(a.warmup),
              "--seed", str(a.seed), "--rendezvous", str(d / "rendezvous.json"),
              "--timeout-s", f"{step_s * a.timeout_scale:.0f}", *spec["args"]]
    if spec["kind"] == "kvxfer":
        common += ["--submit", a.kvxfer_submit]
    env = dict(os.environ)
    for k in spec.get("unset", []):
        env.pop(k, None)
    env.update(spec.get("env", {}))
    env["PYTHONNOUSERSITE"] = "1"
    env.pop("PYTHONPATH", None)
    script = str(PEERS / PEER_SCRIPT[spec["kind"]])
    procs: dict[str, subprocess.Popen] = {}
    files = {}
    t_start = time.monotonic()
    try:
        for role in ("target", "initiator"):
            out = open(d / f"{role}.log", "w")
            files[role] = out
            procs[role] = subprocess.Popen(
                [str(py), "-u", script, "--role", role, "--result", str(d / f"{role}.json"), *common],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=str(d), start_new_session=True,
            )
        timed_out = False
        first_exit: float | None = None
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if now - t_start > pair_deadline:
                timed_out = True
                break
            # One side gone: the other ends by itself through the control socket or its own
            # deadlines; give it a moment, then stop it.
            if any(p.poll() is not None for p in procs.values()):
                first_exit = first_exit or now
                if now - first_exit > 20.0:
                    break
            time.sleep(0.1)
    finally:
        for p in procs.values():
            _kill_group(p)
        for f in files.values():
            f.close()
    elapsed = time.monotonic() - t_start
    ini = _read_json(d / "initiator.json")
    tgt = _read_json(d / "target.json")
    rec: dict[str, Any] = {"system": system, "class": spec["cls"], "workload": wl_name,
                           "label": params["label"], "metric": params["metric"],
                           "wall_s": round(elapsed, 1), "logs": os.path.relpath(d, ROOT)}
    if ini:
        rec["notes"] = ini.get("notes", {})
        rec["kv_completion"] = ini.get("kv_completion")
    reason = None
    if timed_out:
        reason = f"timed out after {pair_deadline:.0f} s"
    elif not ini:
        rc = procs["initiator"].returncode
        reason = f"initiator exited {rc} without a result ({_last_log_line(d / 'initiator.log')})"
    elif not ini.get("ok"):
        reason = ini.get("error", "initiator failed")
    if tgt and not tgt.get("ok"):
        # A target failure usually shows at the initiator only as a closed control socket
        # or a timeout: name the target's own error first.
        reason = f"target: {tgt.get('error')}" + (f"; initiator: {reason}" if reason else "")
    elif reason is None and tgt is None and procs["target"].returncode not in (0, None):
        reason = f"target exited {procs['target'].returncode} without a result ({_last_log_line(d / 'target.log')})"
    measured = [r for r in (ini or {}).get("reps", []) if not r.get("warmup")]
    if reason is None and any(not r.get("verified") for r in (ini or {}).get("reps", [])):
        reason = "data verification failed"
    if reason is None and len(measured) < a.repeats:
        reason = f"only {len(measured)} of {a.repeats} repeats finished"
    rec["reps"] = (ini or {}).get("reps", [])
    if reason:
        rec["status"] = "failed"
        rec["reason"] = str(reason).splitlines()[0][:240]
        return rec
    rec["status"] = "ok"
    rec["verified"] = True
    if params["metric"] == "GB/s":
        key = "recv_s" if wl_name.startswith("kv") else "init_s"
        vals = [r["bytes"] / r[key] / 1e9 for r in measured]
        rec.update(median=statistics.median(vals), min=min(vals), max=max(vals), samples=vals,
                   completion="receiver" if key == "recv_s" else "initiator")
        if wl_name.startswith("kv"):
            iv = [r["bytes"] / r["init_s"] / 1e9 for r in measured]
            rec["initiator_completion_gbps_median"] = statistics.median(iv)
        elif all("recv_s" in r for r in measured):
            # Receiver-side view of the bulk run, for systems that have one (kvxfer imm).
            rv = [r["bytes"] / max(r["recv_s"], r["init_s"]) / 1e9 for r in measured]
            rec["receiver_completion_gbps_median"] = statistics.median(rv)
    else:
        p50 = [r["lat_us"]["p50"] for r in measured]
        p99 = [r["lat_us"]["p99"] for r in measured]
        rec.update(median=statistics.median(p50), min=min(p50), max=max(p50), samples=p50,
                   p99_median=statistics.median(p99), p99_min=min(p99), p99_max=max(p99))
    return rec


# --------------------------------------------------------------------------------------
# Ratios, table, chart, README
# --------------------------------------------------------------------------------------
def add_ratios(results: list[dict[str, Any]], limits: dict[str, Any]) -> None:
    """vs_best_peer: this system against the best non-kvxfer system of its class on the same
    workload (throughput: this / best; latency: best p50 / this p50; > 1 = better)."""
    for r in results:
        if r["status"] != "ok":
            continue
        peers = [p for p in results if p["workload"] == r["workload"] and p["class"] == r["class"]
                 and p["status"] == "ok" and not p["system"].startswith("kvxfer")]
        if r["metric"] == "GB/s":
            lim = limits.get("tcp_loopback_1_stream" if r["class"] == TCP else "memcpy")
            if lim and "median" in lim:
                r["of_limit"] = r["median"] / lim["median"]
        if not peers:
            continue
        if r["metric"] == "GB/s":
            best = max(peers, key=lambda p: p["median"])
            r["vs_best_peer"] = r["median"] / best["median"]
        else:
            best = min(peers, key=lambda p: p["median"])
            r["vs_best_peer"] = best["median"] / r["median"]
        r["best_peer"] = best["system"]
        if r["system"].startswith("kvxfer"):
            r["meets_goal_1_5x"] = r["vs_best_peer"] >= 1.5


def _order(r: dict[str, Any]) -> tuple:
    return (0 if r["class"] == TCP else 1, 0 if r["system"].startswith("kvxfer") else 1, r["system"])


def render_table(results: list[dict[str, Any]], limits: dict[str, Any], meta: dict[str, Any]) -> str:
    """Markdown: one block per workload; kvxfer rows carry the ratio to the best peer."""
    out = []
    lim_txt = ", ".join(
        f"{k.replace('_', ' ')} {v['median']:.2f} GB/s (min {v['min']:.2f}, max {v['max']:.2f})"
        for k, v in limits.items() if "median" in v
    )
    # The machine by its size, not its host name: this text is committed.
    out.append(f"Run {meta['date']} on {meta['cpus']} CPUs; median of "
               f"{meta['repeats']} repeats after {meta['warmup']} warm-up, data verified after each.")
    if meta.get("tcp_congestion_system"):
        out.append(f"TCP congestion control: {meta['tcp_congestion_system']} (the system's, which the other "
                   f"systems use); kvxfer's fabric connections: {meta['kvxfer_tcp_congestion']} "
                   "(its tcp_congestion).")
    if lim_txt:
        out.append(f"Limits: {lim_txt}.")
    out.append("")
    out.append("| workload | system | class | result | min / max | vs best peer of class | of limit |")
    out.append("|---|---|---|---|---|---|---|")
    by_wl: dict[str, list] = {}
    for r in results:
        by_wl.setdefault(r["workload"], []).append(r)
    for wl in [w for w in WORKLOADS if w in by_wl]:
        rows = sorted(by_wl[wl], key=_order)
        label = rows[0]["label"]
        for i, r in enumerate(rows):
            wl_cell = f"**{wl}**<br>{label}" if i == 0 else ""
            if r["status"] != "ok":
                reason = str(r.get("reason", "?")).replace("|", "/")
                reason = reason if len(reason) <= 160 else reason[:157] + "..."
                out.append(f"| {wl_cell} | {r['system']} | {r['class']} | failed: {reason} | | | |")
                continue
            if r["metric"] == "GB/s":
                res = f"{r['median']:.2f} GB/s"
                if "receiver_completion_gbps_median" in r:
                    res += f" (rx {r['receiver_completion_gbps_median']:.2f})"
                mm = f"{r['min']:.2f} / {r['max']:.2f}"
            else:
                res = f"p50 {r['median']:.1f} us, p99 {r['p99_median']:.1f} us"
                mm = f"p50 {r['min']:.1f} / {r['max']:.1f}"
            ratio = ""
            if "vs_best_peer" in r:
                ratio = f"{r['vs_best_peer']:.2f}x"
                if r["system"].startswith("kvxfer"):
                    ratio += f" vs {r['best_peer']} " + ("(goal met)" if r["meets_goal_1_5x"] else "(< 1.5x)")
            elif r["system"].startswith("kvxfer"):
                ratio = "no peer of this class ran"
            of_lim = f"{100 * r['of_limit']:.0f}%" if "of_limit" in r else ""
            out.append(f"| {wl_cell} | {r['system']} | {r['class']} | {res} | {mm} | {ratio} | {of_lim} |")
    out.append("")
    out.append("Throughput is bytes / time from the initiator's first submit to: the initiator's "
               "last completion (bulk), the receiver's completion signal (KV: kvxfer ImmCounter, "
               "NIXL notifications, Mooncake TransferNotify sent after its last batch completed). "
               "(rx X): bulk measured to the receiver's count of all writes, where the system has one. "
               f"Bulk submission: kvxfer {meta.get('kvxfer_submit', 'handles')} "
               "(many: write_many into a CompletionCounter; handles: a handle per write), "
               f"{meta.get('depth', 64)} in flight; Mooncake batches of 256, 4 in flight; "
               "NIXL 64 requests in flight. "
               "Latency: one 4 KiB write submitted and waited for, one at a time. "
               "\"of limit\": share of one loopback TCP stream (TCP class) or of memcpy (same-host).")
    return "\n".join(out)


def render_chart(results: list[dict[str, Any]], limits: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart"
    systems = sorted({r["system"] for r in results}, key=lambda s: _order({"system": s, "class": SYSTEMS[s]["cls"]}))
    tput = [w for w in WORKLOADS if any(r["workload"] == w and r["metric"] == "GB/s" for r in results)]
    has_lat = any(r["workload"] == "lat-4k" for r in results)
    fig, axes = plt.subplots(1, 2 if has_lat else 1, figsize=(15 if has_lat else 11, 5.5),
                             gridspec_kw={"width_ratios": [3, 1]} if has_lat else None, squeeze=False)
    cmap = plt.get_cmap("tab10")
    colors = {s: cmap(i % 10) for i, s in enumerate(systems)}
    width = 0.8 / max(1, len(systems))

    def bars(ax, wls, key_lo="min", key_hi="max"):
        for i, s in enumerate(systems):
            xs, ys, lo, hi = [], [], [], []
            for j, w in enumerate(wls):
                r = next((r for r in results if r["system"] == s and r["workload"] == w), None)
                if r and r["status"] == "ok":
                    xs.append(j + (i - (len(systems) - 1) / 2) * width)
                    ys.append(r["median"])
                    lo.append(r["median"] - r[key_lo])
                    hi.append(r[key_hi] - r["median"])
                elif r:
                    ax.text(j + (i - (len(systems) - 1) / 2) * width, 0, "x", ha="center",
                            va="bottom", color=colors[s], fontsize=8)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[s], label=s,
                   hatch="//" if s.startswith("kvxfer") else None, edgecolor="black", linewidth=0.4)
        ax.set_xticks(range(len(wls)))
        ax.set_xticklabels(wls)

    ax = axes[0][0]
    if tput:
        bars(ax, tput)
        for name, style in (("tcp_loopback_1_stream", "--"), ("memcpy", ":")):
            if name in limits and "median" in limits[name]:
                ax.axhline(limits[name]["median"], ls=style, color="gray", lw=1)
                ax.text(len(tput) - 0.5, limits[name]["median"], f" {name.replace('_', ' ')}",
                        va="bottom", ha="right", fontsize=8, color="gray")
        ax.set_ylabel("GB/s (median, bars: min-max)")
        ax.set_title("Throughput over loopback (x = failed)")
        ax.legend(fontsize=7, ncol=2)
    if has_lat:
        ax2 = axes[0][1]
        bars(ax2, ["lat-4k"])
        ax2.set_ylabel("p50 latency, us (lower is better)")
        ax2.set_title("4 KiB write latency")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tight_layout complains about long legends only
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


BEGIN, END = "<!-- compare_peers:begin -->", "<!-- compare_peers:end -->"


def update_readme(readme: Path, table: str, force: bool) -> str:
    block = (f"{BEGIN}\n<!-- written by benchmarks/compare_peers.py; edits here are overwritten -->\n"
             f"![compare_peers](results/compare_peers.png)\n\n{table}\n{END}")
    text = readme.read_text() if readme.exists() else ""
    if BEGIN in text and END in text:
        new = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        readme.write_text(new)
        return f"updated the table in {readme}"
    if force:
        readme.parent.mkdir(parents=True, exist_ok=True)
        readme.write_text(text + ("\n" if text and not text.endswith("\n") else "")
                          + "\n## kvxfer vs Mooncake and NIXL (compare_peers.py)\n\n" + block + "\n")
        return f"appended the table to {readme}"
    return f"{readme} has no {BEGIN} markers: not updated (use --update-readme to append them)"


# --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="all",
                   help=f"comma list of systems or groups ({', '.join(SYSTEM_GROUPS)}); "
                        f"systems: {', '.join(SYSTEMS)}")
    p.add_argument("--workloads", default="all", help=f"comma list: {', '.join(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=5, help="measured repeats per system/workload")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured repeats first")
    p.add_argument("--bulk-bytes", type=machine_limits.parse_size, default=1 << 30,
                   help="bytes per bulk repeat (default 1G)")
    p.add_argument("--kv-tokens", default="4096,16384", help="tokens of kv-4k,kv-16k (default 4096,16384)")
    p.add_argument("--lat-iters", type=int, default=2000, help="4 KiB writes per latency repeat")
    p.add_argument("--depth", type=int, default=64, help="kvxfer writes in flight in bulk runs")
    p.add_argument("--kvxfer-submit", choices=("many", "handles"), default="many",
                   help="kvxfer's bulk writes: many = write_many into a CompletionCounter (its API "
                        "for many writes, as Mooncake's batches are its); handles = one handle per write")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: bulk 64 MiB, kv 512/1024 tokens, 200 latency samples, "
                        "2 repeats, limits on 256 MiB")
    p.add_argument("--no-limits", action="store_true", help="skip memcpy / TCP stream limits")
    p.add_argument("--limit-bytes", type=machine_limits.parse_size, default=1 << 30)
    p.add_argument("--install-nixl", action="store_true",
                   help="create .bench-venvs/nixl and pip install NIXL if missing")
    p.add_argument("--no-install", action="store_true", help="never create venvs (skip instead)")
    p.add_argument("--mooncake-spec", default=MOONCAKE_SPEC)
    p.add_argument("--nixl-spec", default=NIXL_SPEC)
    p.add_argument("--kvxfer-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--base-python", default=None, help="python used to create the peer venvs")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every deadline")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--readme", type=Path, default=HERE / "README.md",
                   help="README whose marked table is refreshed (default benchmarks/README.md)")
    p.add_argument("--update-readme", action="store_true",
                   help="append the marked section to --readme if it has none")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.bulk_bytes = min(a.bulk_bytes, 64 << 20)
        if a.kv_tokens == "4096,16384":
            a.kv_tokens = "512,1024"
        a.lat_iters = min(a.lat_iters, 200)
        a.repeats = min(a.repeats, 2)
        a.limit_bytes = min(a.limit_bytes, 256 << 20)
    a.kv_tokens = [int(x) for x in str(a.kv_tokens).split(",")]
    if len(a.kv_tokens) != 2:
        p.error("--kv-tokens needs two values")
    names: list[str] = []
    for s in a.systems.split(","):
        s = s.strip()
        if s in SYSTEM_GROUPS:
            names += SYSTEM_GROUPS[s]
        elif s in SYSTEMS:
            names.append(s)
        else:
            p.error(f"unknown system {s!r}")
    a.system_list = list(dict.fromkeys(names))
    a.workload_list = WORKLOADS if a.workloads == "all" else [w.strip() for w in a.workloads.split(",")]
    for w in a.workload_list:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    return a


def _system_congestion_control() -> str:
    """The system's TCP congestion control ("" where procfs does not say)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety; the run must not depend on it
        tqdm = None
    out_dir: Path = a.out_dir
    run_dir = out_dir / "compare_peers_logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "repeats": a.repeats,
            "warmup": a.warmup, "quick": a.quick, "argv": sys.argv[1:],
            "mooncake_spec": a.mooncake_spec, "nixl_spec": a.nixl_spec,
            "kvxfer_submit": a.kvxfer_submit, "depth": a.depth,
            "tcp_congestion_system": _system_congestion_control(),
            "kvxfer_tcp_congestion": os.environ.get("KVXFER_TCP_CONGESTION", "").strip() or "cubic,reno"}
    tasks = [(s, w) for s in a.system_list for w in a.workload_list]
    bar = tqdm(total=len(tasks) + (0 if a.no_limits else 2), unit="run", file=sys.stderr,
               disable=a.no_progress) if tqdm else None

    def say(msg: str) -> None:
        (bar.write if bar else print)(msg, file=sys.stderr)

    limits: dict[str, Any] = {}
    if not a.no_limits:
        for name, fn in (("memcpy", machine_limits.memcpy_gbps),
                         ("tcp_loopback_1_stream", machine_limits.tcp_stream_gbps)):
            if bar:
                bar.set_description(f"limit {name}")
            try:
                limits[name] = fn(a.limit_bytes, max(3, a.repeats))
                say(f"limit {name}: {limits[name]['median']:.2f} GB/s")
            except Exception as e:  # noqa: BLE001
                limits[name] = {"error": f"{type(e).__name__}: {e}"}
                say(f"limit {name}: failed: {e}")
            if bar:
                bar.update(1)
    pythons: dict[str, Path | Skip] = {}
    results: list[dict[str, Any]] = []
    for system, wl in tasks:
        kind = SYSTEMS[system]["kind"]
        if bar:
            bar.set_description(f"{system} {wl}")
        if kind not in pythons:
            try:
                if bar and kind != "kvxfer":
                    bar.set_description(f"{kind} venv")
                pythons[kind] = ensure_venv(kind, a, run_dir)
            except Skip as e:
                pythons[kind] = e
            except Exception as e:  # noqa: BLE001
                pythons[kind] = Skip(f"environment set-up failed: {type(e).__name__}: {e}")
            if isinstance(pythons[kind], Skip):
                say(f"{kind}: skipped: {pythons[kind]}")
        py = pythons[kind]
        if isinstance(py, Skip):
            rec = {"system": system, "class": SYSTEMS[system]["cls"], "workload": wl,
                   "label": workload_params(wl, a)["label"], "metric": workload_params(wl, a)["metric"],
                   "status": "failed", "reason": f"skipped: {py}"}
        else:
            try:
                rec = run_pair(system, wl, py, a, run_dir)
            except Exception as e:  # noqa: BLE001 - one broken system must not end the run
                rec = {"system": system, "class": SYSTEMS[system]["cls"], "workload": wl,
                       "label": workload_params(wl, a)["label"], "metric": workload_params(wl, a)["metric"],
                       "status": "failed", "reason": f"harness error: {type(e).__name__}: {e}"}
            if rec["status"] == "ok":
                unit = "us p50" if rec["metric"] == "us" else "GB/s"
                say(f"{system:18s} {wl:9s} {rec['median']:8.2f} {unit} (min {rec['min']:.2f}, max {rec['max']:.2f})")
            else:
                say(f"{system:18s} {wl:9s} failed: {rec['reason']}")
        results.append(rec)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    add_ratios(results, limits)
    table = render_table(results, limits, meta)
    (out_dir / "compare_peers.md").write_text(table + "\n")
    chart_note = render_chart(results, limits, out_dir / "compare_peers.png")
    with open(out_dir / "compare_peers.json", "w") as f:
        json.dump({"meta": meta, "limits": limits, "results": results, "table_markdown": table}, f, indent=1)
    print(table)
    print()
    print(f"wrote {out_dir / 'compare_peers.json'}, {out_dir / 'compare_peers.md'}"
          + ("" if chart_note else f", {out_dir / 'compare_peers.png'}"))
    if chart_note:
        print(chart_note)
    print(update_readme(a.readme, table, a.update_readme))
    return 0


if __name__ == "__main__":
    sys.exit(main())
