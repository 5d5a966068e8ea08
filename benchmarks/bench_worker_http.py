"""How long does one call to a worker take, and what does that add to time to first token?

Every disaggregated request makes the router call its workers twice in a row before the
first token: POST /reserve to the decoder, then POST /prefill and the streaming POST
/generate together. This starts a local cluster (`LocalCluster`: etcd, router, 1 prefill
+ 1 decode worker, net on loopback, cluster key on) and measures, medians over --calls:

  worker GET /health   a signed call to the decode worker that does no work: the worker's
                       HTTP round trip.
  worker /reserve      the router's first leg, made directly: reserve, then cancel.
  TTFT via router      a streaming completion of a --prompt-tokens prompt, to its first
                       SSE data line, at the client.
  new connections      sockets to the decode worker left in TIME-WAIT by the TTFT loop,
                       per request: 0 when the router reuses its connections, 1 when each
                       request opened one (each waits a minute in TIME-WAIT).

Beside them, the machine's floors for the same round trip, in the same run:

  bare uvicorn         GET of a FastAPI route returning a constant, served by uvicorn in
                       another process (what the workers' HTTP stack costs without kvxfer).
  TCP ping-pong        one byte each way over a loopback TCP connection between two
                       processes (what any request/reply over loopback costs here).

Prints a table, writes JSON and a PNG. On a shared 2-core machine compare the ratios of
one run.

    .venv/bin/python benchmarks/bench_worker_http.py [--calls 200] [--requests 100]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import httpx

from kvxfer.cluster.local_cluster import LocalCluster

HERE = Path(__file__).resolve().parent
START_WAIT_S = 30.0

_BARE_UVICORN = """
import socket, sys
import uvicorn
from fastapi import FastAPI
app = FastAPI()
@app.get("/health")
def health() -> dict:
    return {"status": "ok"}
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""

_TCP_ECHO = """
import socket
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := conn.recv(1)):
    conn.sendall(b)
"""


def median_ms(fn: Callable[[], Any], calls: int) -> tuple[float, list[float]]:
    """Median wall time of `fn` over `calls` calls after 5 unrecorded ones, and the samples."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), samples


def helper_port(code: str) -> tuple[subprocess.Popen[str], int]:
    """Starts `code` in another Python process; returns it and the port it printed."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.strip():
        proc.kill()
        raise RuntimeError("helper process did not start")
    return proc, int(line)


def floors(calls: int) -> dict[str, tuple[float, list[float]]]:
    """The bare uvicorn round trip and the TCP ping-pong, each in a process of its own."""
    out = {}
    uv, port = helper_port(_BARE_UVICORN)
    try:
        deadline = time.monotonic() + START_WAIT_S
        with httpx.Client(trust_env=False, timeout=10) as client:
            while time.monotonic() < deadline:
                try:
                    client.get(f"http://127.0.0.1:{port}/health")
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
            out["bare uvicorn GET"] = median_ms(lambda: client.get(f"http://127.0.0.1:{port}/health"), calls)
    finally:
        uv.kill()
        uv.wait()
    echo, port = helper_port(_TCP_ECHO)
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def ping() -> None:
                conn.sendall(b"x")
                conn.recv(1)

            out["TCP ping-pong"] = median_ms(ping, calls)
    finally:
        echo.kill()
        echo.wait()
    return out


def time_wait_sockets_to(port: int) -> int:
    """TCP sockets of this machine in TIME-WAIT whose peer is local `port` (IPv4)."""
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for row in table:
            fields = row.split()
            if fields[3] == "06" and int(fields[2].split(":")[1], 16) == port:
                count += 1
    return count


def ttft_ms(client: httpx.Client, router_url: str, prompt: str) -> float:
    """Milliseconds from sending a streamed completion to its first SSE data line. The
    stream is read to its end: a client that hangs up after the first token makes the
    router cancel the request's legs, which is not what is measured here."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{router_url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: "):
                first = (time.perf_counter() - t0) * 1e3
    if first is None:
        raise RuntimeError("stream ended without data")
    return first


def cluster_rows(calls: int, requests: int, prompt_tokens: int) -> tuple[dict[str, tuple[float, list[float]]], float]:
    """The worker and router rows, and the new connections to the decoder per request."""
    cluster = LocalCluster(prefill=1, decode=1, router_env={"KVXFER_ROUTER_DISAGGREGATION_MIN_PROMPT_TOKENS": "0"})
    out = {}
    try:
        cluster.start()
        workers = httpx.get(f"{cluster.admin_url}/workers", timeout=5).json()["workers"]
        decode = next(w for w in workers if w["role"] == "decode")
        prefill = next(w for w in workers if w["role"] == "prefill")
        tokens = list(range(1, prompt_tokens + 1))
        with httpx.Client(auth=cluster.control_auth, trust_env=False, timeout=30) as signed:
            out["worker GET /health"] = median_ms(lambda: signed.get(f"{decode['http_url']}/health"), calls)

            def reserve() -> None:
                rid = f"bench-{uuid.uuid4().hex}"
                reply = signed.post(f"{decode['http_url']}/reserve", json={
                    "request_id": rid, "prompt_tokens": tokens, "max_tokens": 2,
                    "prefill_engine_address": prefill["engine_address"]})
                reply.raise_for_status()
                signed.post(f"{decode['http_url']}/cancel", json={"request_id": rid})

            out["worker /reserve (+ /cancel untimed)"] = median_ms(reserve, calls)
            # /cancel is timed above too; take it off so the row is /reserve's own.
            cancel_ms = median_ms(lambda: signed.post(f"{decode['http_url']}/cancel",
                                                      json={"request_id": "bench-unknown"}), calls)[0]
            ms, samples = out.pop("worker /reserve (+ /cancel untimed)")
            out["worker /reserve"] = (ms - cancel_ms, [s - cancel_ms for s in samples])
        prompt = ("kv cache page prefill decode " * 64)[: prompt_tokens - 1]
        decode_port = int(decode["http_url"].rsplit(":", 1)[1])
        with httpx.Client(trust_env=False, timeout=60) as client:
            for _ in range(5):  # unrecorded, as median_ms does
                ttft_ms(client, cluster.router_url, prompt)
            before = time_wait_sockets_to(decode_port)
            samples = [ttft_ms(client, cluster.router_url, prompt) for _ in range(requests)]
            new_per_request = (time_wait_sockets_to(decode_port) - before) / requests
            out["TTFT via router"] = (statistics.median(samples), samples)
    finally:
        cluster.stop()
    return out, new_per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per worker round-trip row and floor")
    parser.add_argument("--requests", type=int, default=100, help="timed completions for the TTFT row")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of /reserve and the completions")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where JSON and PNG go")
    parser.add_argument("--name", default="bench_worker_http", help="output file stem")
    args = parser.parse_args()

    cluster, new_per_request = cluster_rows(args.calls, args.requests, args.prompt_tokens)
    rows = {**cluster, **floors(args.calls)}
    floor = rows["bare uvicorn GET"][0]
    print(f"{'round trip':<24}{'p50 ms':>9}{'p90 ms':>9}{'x bare uvicorn':>16}")
    for name, (p50, samples) in rows.items():
        p90 = sorted(samples)[int(0.9 * (len(samples) - 1))]
        print(f"{name:<24}{p50:>9.2f}{p90:>9.2f}{p50 / floor:>16.2f}")
    print(f"new connections to the decoder per request: {new_per_request:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rows": {k: {"p50_ms": v[0], "samples_ms": v[1]} for k, v in rows.items()},
              "new_decoder_connections_per_request": new_per_request,
              "calls": args.calls, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
              "loadavg": os.getloadavg()}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(rows)
    ax.barh(names, [rows[n][0] for n in names])
    ax.set_xscale("log")
    ax.set_xlabel("median ms (log)")
    ax.set_title("worker round trips against the machine's floors")
    fig.tight_layout()
    fig.savefig(args.out / f"{args.name}.png", dpi=110)
    plt.close(fig)
    print(f"wrote {args.out / (args.name + '.json')} and .png")


if __name__ == "__main__":
    main()
