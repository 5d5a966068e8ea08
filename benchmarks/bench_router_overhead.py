"""What kvxfer's router costs a vLLM user: time to first token through the router against
the same requests sent to the instances directly (the two legs by hand, as the router
sends them), in one run on the same vLLM prefill + decode pair. Table printed, JSON and
PNG written. The goal (issue 33): TTFT p50 through the router at most 2 ms above direct.

Requests alternate (direct, router, direct, ...) so drift on a busy machine hits both
alike; every request has its own cache salt, so no prefix cache is shared. TTFT is
measured at the client from sending the request(s) to the first streamed token. Direct:
the prefill leg (max_tokens 1, not streamed) and the decode leg (streamed) leave at once
from two threads, each with `kv_transfer_params` naming the other instance's engine.

    .venv/bin/python benchmarks/bench_router_overhead.py                # 64..1024 tokens, 20 each
    .venv/bin/python benchmarks/bench_router_overhead.py --quick        # 64 and 256 tokens, 8 each
    .venv/bin/python benchmarks/bench_router_overhead.py --stub-instances   # where the router's time goes

`--stub-instances` answers for vLLM from stub instances that reply at once (an answer for
the prefill leg, two events and [DONE] for the decode leg), so that only the router's own
work separates the two paths, and stamps each step of every routed request inside the
router (benchmarks/router_overhead_stamps.py, wrapped around the router from outside):
the table gives each step's median and the router's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvxfer.integrations.vllm.checkpoint import make_checkpoint  # noqa: E402
from support.vllm_instances import VllmFleet, router_process  # noqa: E402

REQUEST_TIMEOUT_S = 300.0
MODEL = "bench"


def renice_instances(fleet: VllmFleet, niceness: int) -> int:
    """Lowers the CPU priority of every thread of the fleet's vLLM processes (Linux keeps
    a niceness per thread, so each task of each process is set). Returns the threads set.

    On a machine with as many cores as instances, each instance keeps its core busy while a
    request is in flight, and the router (or the direct client) waits for a core at each
    wake-up; a lower priority for the instances models a router with a core of its own, as
    in a deployment where it runs in its own pod. Both paths get the same instances."""
    import psutil  # installed with vLLM; the tree, as vLLM's API server starts its EngineCore as a child

    done = 0
    for inst in fleet.instances.values():
        root = psutil.Process(inst.process.pid)
        for process in [root, *root.children(recursive=True)]:
            for task in Path(f"/proc/{process.pid}/task").glob("*"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)
                    done += 1
                except (ProcessLookupError, PermissionError):
                    pass
    return done


def prompt_of(n: int, seed: int) -> list[int]:
    """`n` token ids (above the specials), different per seed."""
    return [3 + (seed * 7919 + i * 104729) % 1900 for i in range(n)]


def first_token_s(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str],
                  start: float) -> float:
    """Seconds from `start` to the first streamed chunk that carries a token."""
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                       timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            # A token whose bytes do not end a character streams no text: its id counts.
            if line.startswith("data: {") and any(c.get("text") or c.get("token_ids")
                                                  for c in json.loads(line[6:]).get("choices", ())):
                ttft = time.perf_counter() - start
                for _ in lines:  # the rest, so the answer is whole before the next request
                    pass
                return ttft
    raise RuntimeError("no token streamed")


class DirectLegs:
    """Both legs by hand, as the router sends them, on kept-alive connections (as the
    router's own client keeps them)."""

    def __init__(self, fleet: VllmFleet) -> None:
        self.fleet = fleet
        self.prefill_engine = fleet.record("prefill").engine_address
        self.decode_engine = fleet.record("decode").engine_address
        self.prefill = httpx.Client(headers=fleet.headers, timeout=REQUEST_TIMEOUT_S)
        self.decode = httpx.Client(timeout=REQUEST_TIMEOUT_S)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def ttft(self, body: dict[str, Any]) -> float:
        tid = f"bench-{uuid.uuid4().hex}"
        start = time.perf_counter()
        leg_p = self.pool.submit(self.prefill.post, self.fleet.instances["prefill"].url + "/v1/completions", json={
            **body, "max_tokens": 1, "kv_transfer_params": {"kvxfer": {
                "role": "prefill", "transfer_id": tid, "peer_engine": self.decode_engine}}})
        ttft = first_token_s(self.decode, self.fleet.instances["decode"].url, {**body, "kv_transfer_params": {
            "kvxfer": {"role": "decode", "transfer_id": tid, "peer_engine": self.prefill_engine}}},
            self.fleet.headers, start)
        leg_p.result().raise_for_status()
        return ttft

    def close(self) -> None:
        self.pool.shutdown()
        self.prefill.close()
        self.decode.close()


def run(fleet: VllmFleet, router: str, lengths: list[int], repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    direct_legs = DirectLegs(fleet)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for n in lengths:
            for rep in range(repeats):
                body = {"model": MODEL, "prompt": prompt_of(n, rep), "max_tokens": max_tokens, "temperature": 0,
                        "return_token_ids": True}
                direct = direct_legs.ttft({**body, "cache_salt": uuid.uuid4().hex})
                routed = first_token_s(client, router, {**body, "cache_salt": uuid.uuid4().hex}, {},
                                       time.perf_counter())
                rows.append({"path": "direct", "tokens": n, "ttft_s": direct})
                rows.append({"path": "router", "tokens": n, "ttft_s": routed})
            print(f"  {n:5d} tokens done", flush=True)
    direct_legs.close()
    return rows


def summary(rows: list[dict[str, Any]], lengths: list[int]) -> list[dict[str, Any]]:
    out = []
    for n in lengths:
        direct = [r["ttft_s"] for r in rows if r["tokens"] == n and r["path"] == "direct"]
        routed = [r["ttft_s"] for r in rows if r["tokens"] == n and r["path"] == "router"]
        d50, r50 = statistics.median(direct), statistics.median(routed)
        out.append({"tokens": n, "direct_p50_ms": d50 * 1e3, "router_p50_ms": r50 * 1e3,
                    "router_minus_direct_ms": (r50 - d50) * 1e3, "samples": len(direct)})
    return out


# ---- --stub-instances: the router's own cost, step by step --------------------------------

STUB_EVENTS = [json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": MODEL, "choices": [
    {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": [tok]}],
    "usage": None}, separators=(",", ":")).encode() for text, finish, tok in (("a", None, 5), ("b", "length", 6))]
STUB_ANSWER = json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": MODEL, "choices": [
    {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}], "usage": {
    "prompt_tokens": 64, "total_tokens": 65, "completion_tokens": 1}, "kv_transfer_params": None}).encode()


async def _stub_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One keep-alive connection of a stub vLLM instance: answers every POST at once."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if body.get("stream"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for event in [b"data: " + e + b"\n\n" for e in STUB_EVENTS] + [b"data: [DONE]\n\n"]:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(STUB_ANSWER), STUB_ANSWER))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def start_stub_instance() -> int:
    """A stub vLLM instance in a thread of this process; its port."""
    ready: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def serve() -> None:
        server = await asyncio.start_server(_stub_connection, "127.0.0.1", 0)
        ready.set_result(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    return ready.result(timeout=30)


_STUB_ROUTER = """
import os, sys
sys.path.insert(0, os.environ["KVXFER_BENCH_DIR"])
import router_overhead_stamps  # wraps the router's steps before the app is built
from kvxfer_router import StaticWorkerDirectory, RouterSettings, app
from kvxfer_router.cli import serve
stub = os.environ["KVXFER_STUB_URL"]
workers = [dict(worker_id=f"{role}-stub", role=role, http_url=stub, model="bench", kv_layout="stub",
                engine_address="00" * 8, engine="vllm", total_pages=1000, free_pages=1000)
           for role in ("prefill", "decode")]
# Every request has the same prompt: kv_aware would find it cached on the decoder and send
# no prefill leg; both legs are what is measured.
settings = RouterSettings(host="127.0.0.1", port=int(os.environ["KVXFER_ROUTER_PORT"]), log_level="warning",
                          policy="least_loaded")
serve(app.create_app(settings, StaticWorkerDirectory(workers)), None, settings)
"""


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_stub(requests: int, tokens: int, work: Path) -> dict[str, Any]:
    """Direct and routed TTFT against a stub instance, the router's steps and its CPU."""
    from support.vllm_instances import free_port

    stub_url = f"http://127.0.0.1:{start_stub_instance()}"
    port, stamps = free_port(), work / "stamps.json"
    env = {**os.environ, "KVXFER_BENCH_DIR": str(Path(__file__).resolve().parent), "KVXFER_STUB_URL": stub_url,
           "KVXFER_ROUTER_PORT": str(port), "KVXFER_ROUTER_STAMPS": str(stamps)}
    env.pop("KVXFER_ROUTER_CLUSTER_KEY_FILE", None)  # vLLM legs carry only an API key; none here
    with (work / "router.log").open("w") as log:
        router = subprocess.Popen([sys.executable, "-c", _STUB_ROUTER], env=env, stdout=log, stderr=subprocess.STDOUT)
    router_url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": prompt_of(tokens, 0), "max_tokens": 2, "temperature": 0, "stream": True}
    direct_s, client_stamps = [], []
    warmup = 20
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(router_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or router.poll() is not None:
                raise RuntimeError(f"the router did not start; see {work / 'router.log'}")
            time.sleep(0.1)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client, httpx.Client(timeout=REQUEST_TIMEOUT_S) as prefill, \
                httpx.Client(timeout=REQUEST_TIMEOUT_S) as decode:
            for i in range(warmup + requests):
                if i == warmup:
                    cpu_before = _process_cpu_s(router.pid)
                start = time.perf_counter()
                leg = pool.submit(prefill.post, stub_url + "/v1/completions", json={**body, "stream": False,
                                                                                    "max_tokens": 1})
                direct = first_token_s(decode, stub_url, body, {}, start)
                leg.result().raise_for_status()
                start = time.perf_counter()
                routed = first_token_s(client, router_url, body, {}, start)
                if i >= warmup:
                    direct_s.append(direct)
                    client_stamps.append((start, start + routed))
            cpu_ms = (_process_cpu_s(router.pid) - cpu_before) / requests * 1e3
        pool.shutdown()
    finally:
        router.send_signal(signal.SIGINT)  # uvicorn stops; the stamps are written at exit
        router.wait(30)
    records = json.loads(stamps.read_text())[-requests:]
    steps: dict[str, list[float]] = {}
    for (sent, first), record in zip(client_stamps, records):
        previous, at = "client sends", sent
        for step, stamp in sorted(record.items(), key=lambda item: item[1]):  # the order this request took
            steps.setdefault(f"{previous} -> {step}", []).append((stamp - at) * 1e3)
            previous, at = step, stamp
        steps.setdefault(f"{previous} -> client has the first token", []).append((first - at) * 1e3)
    routed_ms = [(first - sent) * 1e3 for sent, first in client_stamps]
    return {"requests": requests, "prompt_tokens": tokens, "direct_p50_ms": statistics.median(direct_s) * 1e3,
            "router_p50_ms": statistics.median(routed_ms), "router_cpu_ms_per_request": cpu_ms,
            "steps_p50_ms": {name: statistics.median(v) for name, v in steps.items()},
            "load_average": os.getloadavg()}


def _command() -> str:
    """This run's command line, for the JSON: which options (and router settings from the
    environment, which the router process inherits) made the figures."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KVXFER_ROUTER_")]
    return " ".join([*settings, ".venv/bin/python", "benchmarks/bench_router_overhead.py", *sys.argv[1:]])


def main_stub(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kvxfer-router-overhead-") as tmp:
        result = run_stub(args.stub_requests, 64, Path(tmp))
    print(f"\nstub instances, {result['requests']} requests of {result['prompt_tokens']} tokens, load average "
          f"{result['load_average'][0]:.1f}")
    print(f"direct p50 {result['direct_p50_ms']:.2f} ms, through the router p50 {result['router_p50_ms']:.2f} ms "
          f"({result['router_p50_ms'] - result['direct_p50_ms']:+.2f} ms); router CPU per request "
          f"{result['router_cpu_ms_per_request']:.2f} ms")
    print(f"{'step (routed request)':58} {'p50 ms':>8}")
    for name, ms in result["steps_p50_ms"].items():
        print(f"{name:58} {ms:8.3f}")
    out = args.out.with_name(args.out.name + "_stub").with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": _command(), **result}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,256,1024", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="requests per length and path (default 20)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    parser.add_argument("--quick", action="store_true", help="64 and 256 tokens, 8 requests each")
    parser.add_argument("--stub-instances", action="store_true",
                        help="no vLLM: stub instances that answer at once, the router's steps timed (writes OUT_stub.json)")
    parser.add_argument("--stub-requests", type=int, default=300,
                        help="with --stub-instances: requests per path (default 300)")
    parser.add_argument("--instances-nice", type=int, default=0,
                        help="niceness (0-19) for every thread of both vLLM instances once they are ready "
                        "(default 0: unchanged). A router in a pod of its own has a core; on a machine whose cores "
                        "the instances keep busy, a positive value gives the router and the client the core first")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a seeded checkpoint to use (made with kvxfer make-llama); default: a fresh tiny one")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "router_overhead",
                        help="output stem: writes OUT.json and OUT.png (default benchmarks/results/router_overhead)")
    args = parser.parse_args()
    if args.stub_instances:
        main_stub(args)
        return
    lengths = [64, 256] if args.quick else [int(x) for x in args.lengths.split(",")]
    repeats = 8 if args.quick else args.repeats
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvxfer-router-overhead-") as tmp:
        work = Path(tmp)
        model = make_checkpoint(args.model_dir or work / "model")
        with VllmFleet(model, work, served_model_name=MODEL,
                       common_extra={"same_host": False, "bind_host": "127.0.0.1"}) as fleet:
            fleet.start("prefill", "kv_producer", "0")
            fleet.start("decode", "kv_consumer", "1")
            fleet.wait_ready("prefill", "decode")
            if args.instances_nice:
                print(f"instances reniced to {args.instances_nice}: {renice_instances(fleet, args.instances_nice)} threads")
            with router_process(fleet, work / "router.log") as router:
                # One of each first: the first requests pay for warm-up, not the router.
                run(fleet, router, [lengths[0]], 2, args.max_tokens)
                rows = run(fleet, router, lengths, repeats, args.max_tokens)
    table = summary(rows, lengths)
    print(f"\n{'tokens':>7} {'direct p50 ms':>14} {'router p50 ms':>14} {'router - direct':>16}")
    for t in table:
        print(f"{t['tokens']:>7} {t['direct_p50_ms']:>14.1f} {t['router_p50_ms']:>14.1f} "
              f"{t['router_minus_direct_ms']:>+15.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_at_end = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {load_at_start}, at end {load_at_end}")
    args.out.with_suffix(".json").write_text(json.dumps({
        "command": _command(), "instances_nice": args.instances_nice,
        "load_average_at_start": load_at_start, "load_average_at_end": load_at_end,
        "summary": table, "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(lengths))
        ax.bar([x - 0.2 for x in xs], [t["direct_p50_ms"] for t in table], 0.4, label="direct (two legs by hand)")
        ax.bar([x + 0.2 for x in xs], [t["router_p50_ms"] for t in table], 0.4, label="through the router")
        ax.set_xticks(list(xs), [str(n) for n in lengths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.set_title("vLLM + kvxfer: TTFT through the router vs direct")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
