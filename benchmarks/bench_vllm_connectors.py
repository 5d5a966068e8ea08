"""vLLM disaggregated through kvxfer against vLLM disaggregated through its own connectors
(NixlConnector pull, NixlPushConnector, MooncakeConnector), same vLLM, same seeded model,
same prompts, in one run; vLLM colocated is the reference every figure is paired with.

Each configuration runs in its own phase (its instances started, measured, stopped: two
cores and the memory hold one pair at a time), prefill instance on core 0, decode on core 1:
  1. single requests: prompts of --lengths tokens, --repeats each (TTFT, inter-token
     latency, kvxfer's push tail, KV bytes, CPU of both instances);
  2. concurrency: --conc-requests prompts of --conc-tokens at each of --concurrency
     (goodput: requests/s whose TTFT is within --ttft-bound-s);
  3. multi-turn: --conversations conversations of --turns turns, each turn re-sending the
     whole conversation plus --turn-tokens new tokens (prefix hits on both instances);
  4. faults: a decode leg the client drops mid-load, then the prefill instance SIGKILLed
     mid-transfer; time until the decoder's request ends and until its blocks are free:
     when its scheduler had them back (benchmarks/probes/sitecustomize.py, loaded into
     the decode instance, records it), and when a read of its usage gauge showed 0.
Outputs (text and token ids, greedy) of every request are compared with colocated's. A
configuration that cannot run here is shown with its reason.

    .venv/bin/python benchmarks/bench_vllm_connectors.py --install-peers --quick   # minutes
    .venv/bin/python benchmarks/bench_vllm_connectors.py --install-peers           # the table in README
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vllm_connector import prompt_of  # noqa: E402
from decoder_free_figures import free_cell, gauge_cell, ratio_line, scheduler_free_after  # noqa: E402
from paired_overhead import goodput_rps, paired_overhead_s, ratio_to_best_peer  # noqa: E402
from vllm_connector_flows import (CONFIGS, Config, Pair, PeerUnavailable, StreamResult, ensure_peer_env,
                                  stream_completion,  # noqa: E402
                                  CONNECTOR_COUNTERS, instance_tree_cpu_s, kv_cache_usage, last_error_line, metrics_text,
                                  prom_value, start_pair)

from kvxfer.integrations.vllm.checkpoint import CheckpointShape, make_checkpoint  # noqa: E402
from kvxfer.integrations.vllm.liveness_keeper import HELD  # noqa: E402
from kvxfer.integrations.vllm.prefiller_liveness import parse_liveness_address  # noqa: E402
from support.vllm_instances import VllmFleet  # noqa: E402

#: 8 layers x 8 KV heads x head dim 128 x bf16 x (K, V) = 32 KiB of KV per token, with
#: small MLP and vocabulary so that compute stays cheap on a CPU core.
SHAPE = CheckpointShape(layers=8, hidden=1024, heads=8, kv_heads=8, intermediate=1024, vocab=2048,
                        max_positions=16384)
KV_BYTES_PER_TOKEN = SHAPE.layers * SHAPE.kv_heads * (SHAPE.hidden // SHAPE.heads) * 2 * 2
BLOCK_TOKENS = 32  # the instances' --block-size (VllmInstanceSpec's default)
#: Default pause between two reads of an instance's /metrics while a drill waits for its
#: blocks to free (--gauge-poll-ms). A read takes milliseconds of the instance's own core
#: (its API server renders every metric), so a short pause keeps that core busy exactly
#: while the decoder it measures must notice the fault; the gauge figure's resolution is
#: the gap between reads, reported beside it ("resolution_ms"), the same for every
#: configuration.
GAUGE_POLL_MS = 20.0
#: Pause between two looks at the decoder's block probe file when no gauge is read.
PROBE_POLL_S = 0.05
#: How long a request's transfer counters may take to appear on /metrics after its answer.
COUNTERS_WAIT_S = 3.0
#: Before a phase starts its instances (about 3 GiB each): wait while the machine has less
#: than this much memory available, for at most MEMORY_WAIT_S, polling every MEMORY_POLL_S.
MEMORY_NEEDED_GIB = 7.0
MEMORY_WAIT_S = 300.0
MEMORY_POLL_S = 10.0


def body_of(tokens: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
    """A greedy completion request of the served model."""
    return {"model": "bench", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt,
            "ignore_eos": True}


def transfer_time(before: dict[str, float], after: dict[str, float]) -> tuple[str, float] | None:
    """(what, seconds per transfer) between two counter snapshots: kvxfer's push tail after
    the last layer's compute, or NIXL's transfer time (its whole read or write, which starts
    after prefill); None where the connector counted none."""
    for what, base in (("push tail", "kvxfer_connector_push_tail_seconds"), ("NIXL xfer", "vllm:nixl_xfer_time_seconds")):
        n = after[base + "_count"] - before[base + "_count"]
        if n > 0:
            return what, (after[base + "_sum"] - before[base + "_sum"]) / n
    return None


def cpu_s(pair: Pair) -> float:
    """CPU seconds both instances' process trees have used so far."""
    return sum(instance_tree_cpu_s(i) for i in pair.instances())


def result_row(res: StreamResult | None, err: str | None, **keys: Any) -> dict[str, Any]:
    """One request's JSON row."""
    if res is None:
        return {**keys, "error": err}
    return {**keys, "ttft_s": res.ttft_s, "itl_s": res.gaps_s, "text": res.text, "token_ids": res.token_ids}


def run_single(pair: Pair, args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    """Phase part 1: single requests over every length; CPU and KV bytes over the whole sweep."""
    rows: list[dict[str, Any]] = []
    cpu_total = 0.0
    counted0 = pair.counters()
    kv_bytes = 0
    for n in args.lengths:
        for rep in range(args.repeats):
            salt = uuid.uuid4().hex
            colo_ttft = None
            if pair.config.kind != "colocated":
                # The same prompt colocated on this pair's prefill instance right before: the
                # overhead is paired within the phase, so other users' load, which drifts
                # between phases on a shared machine, hits both sides of a pair alike.
                try:
                    colo_ttft = stream_completion(pair.url(pair.prefill), body_of(prompt_of(n, rep), args.max_tokens,
                                                                                  "colo-" + salt),
                                                  pair.fleet.headers, args.request_timeout_s).ttft_s
                except (httpx.HTTPError, RuntimeError):
                    pass
            before = pair.counters() if pair.config.kind != "colocated" else {}
            cpu_before = cpu_s(pair)
            try:
                res, err = pair.serve(body_of(prompt_of(n, rep), args.max_tokens, salt)), None
            except (httpx.HTTPError, RuntimeError) as e:
                res, err = None, f"{type(e).__name__}: {str(e)[:200]}"
            row = result_row(res, err, tokens=n, rep=rep)
            if colo_ttft is not None:
                row["colo_ttft_s"] = colo_ttft
            if res is not None and res.prefill_leg_s is not None:
                row["prefill_leg_s"] = res.prefill_leg_s
            if before and res is not None:
                deadline = time.monotonic() + COUNTERS_WAIT_S
                while (measured := transfer_time(before, pair.counters())) is None and time.monotonic() < deadline:
                    time.sleep(0.05)  # a transfer's metrics land once its last write completed
                if measured:
                    row["transfer_what"], row["transfer_s"] = measured
            # Only the served request's own time counts (not the colocated run before it).
            cpu_total += cpu_s(pair) - cpu_before
            if pair.config.kind != "colocated":
                kv_bytes += math.ceil(n / BLOCK_TOKENS) * BLOCK_TOKENS * KV_BYTES_PER_TOKEN
            rows.append(row)
            progress.update(1)
    out: dict[str, Any] = {"rows": rows, "cpu_s": cpu_total}
    counted = pair.counters()
    moved = sum(counted[k] - counted0[k] for k in ("kvxfer_connector_pushed_bytes_total",
                                                   "vllm:nixl_bytes_transferred_sum"))
    if moved > 0:
        out["kv_bytes"] = moved
        out["kv_bytes_source"] = "the connector's counter"
    elif pair.config.kind != "colocated":
        out["kv_bytes"] = kv_bytes
        out["kv_bytes_source"] = "computed: the prompts' whole blocks x 32 KiB per token"
    return out


def run_concurrency(pair: Pair, args: argparse.Namespace, progress: Any) -> list[dict[str, Any]]:
    """Phase part 2: batches of requests `c` at a time; goodput under the TTFT bound."""
    out = []
    for c in args.concurrency:
        bodies = [body_of(prompt_of(args.conc_tokens, 5000 + 100 * c + i), args.max_tokens, uuid.uuid4().hex)
                  for i in range(args.conc_requests)]

        def one(body: dict[str, Any]) -> float | None:
            try:
                return pair.serve(body).ttft_s
            except (httpx.HTTPError, RuntimeError):
                return None
            finally:
                progress.update(1)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(c) as pool:
            ttfts = list(pool.map(one, bodies))
        wall = time.perf_counter() - start
        ok = [t for t in ttfts if t is not None]
        out.append({"concurrency": c, "requests": len(bodies), "failed": len(bodies) - len(ok), "wall_s": wall,
                    "ttft_s": ttfts, "ttft_median_s": statistics.median(ok) if ok else None,
                    "goodput_rps": goodput_rps(ttfts, wall, args.ttft_bound_s)})
    return out


def run_multi_turn(pair: Pair, args: argparse.Namespace, progress: Any) -> list[dict[str, Any]]:
    """Phase part 3: conversations whose every turn re-sends the whole conversation so far."""
    rows = []
    for conv in range(args.conversations):
        salt = uuid.uuid4().hex  # one per conversation: its turns share a prefix cache
        history: list[int] = []
        for turn in range(args.turns):
            history = history + prompt_of(args.turn_tokens, 9000 + 31 * conv + turn)
            try:
                res, err = pair.serve(body_of(history, args.max_tokens, salt)), None
            except (httpx.HTTPError, RuntimeError) as e:
                res, err = None, f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(result_row(res, err, conversation=conv, turn=turn, tokens=len(history)))
            # The next turn carries this one's answer, as a chat client re-sends it.
            history = history + (res.token_ids if res else prompt_of(args.max_tokens, 77))
            progress.update(1)
    return rows


class FreeWatch:
    """Reads an instance's KV cache usage in a thread, from before a fault until its blocks
    are free: each read (time, usage) is kept, so the moment they freed is known to within
    one read's gap, whenever the drill looks.

    Free means a read of 0 after a non-zero one (the request's blocks were seen held), or
    after the request ended (a pull decoder may not have allocated yet when the fault came).
    """

    def __init__(self, url: str, deadline_s: float, poll_s: float) -> None:
        self.url = url
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        self.samples: list[tuple[float, float | None]] = []
        self.request_ended: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> FreeWatch:
        self._thread.start()
        return self

    def _free_index(self) -> int | None:
        held = False
        for i, (t, usage) in enumerate(self.samples):
            if usage:
                held = True
            elif usage == 0.0 and (held or (self.request_ended is not None and t >= self.request_ended)):
                return i
        return None

    def _run(self) -> None:
        start = time.perf_counter()
        with httpx.Client(timeout=5) as client:
            while time.perf_counter() - start < self.deadline_s and self._free_index() is None:
                try:
                    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", client.get(self.url + "/metrics").text,
                                  re.M)
                    usage = float(m.group(1)) if m else None
                except httpx.HTTPError:
                    usage = None
                self.samples.append((time.perf_counter(), usage))
                time.sleep(self.poll_s)

    def free_after(self, since: float) -> dict[str, Any]:
        """Waits for the thread; {"free_s": seconds from `since` to the first free read, or
        None past the deadline; "resolution_ms": the gap to the read before it}."""
        self._thread.join(self.deadline_s + 10)
        i = self._free_index()
        if i is None:
            return {"free_s": None, "resolution_ms": None}
        gap = self.samples[i][0] - self.samples[i - 1][0] if i > 0 else None
        return {"free_s": self.samples[i][0] - since, "resolution_ms": gap * 1e3 if gap is not None else None}


def watch_sockets_closed(liveness_address: str, deadline_s: float) -> dict[str, float]:
    """Starts a thread holding a connection to a kvxfer prefill instance's liveness port;
    the returned dict gets "at" (perf_counter) once its close was read: when the kernel
    closed the killed process's sockets, the earliest any connector can notice. The thread
    sleeps in recv() until then: a polling loop here took CPU from the instances it times."""
    out: dict[str, float] = {}

    def run() -> None:
        try:
            with socket.create_connection(parse_liveness_address(liveness_address), timeout=5.0) as conn:
                if conn.recv(1) != HELD:  # a keeper at its bound: no signal from this connection
                    return
                conn.settimeout(deadline_s)
                try:
                    conn.recv(1)  # the keeper sends nothing after HELD: this returns at its close
                except ConnectionResetError:
                    pass
                out["at"] = time.perf_counter()
        except OSError:  # no connection, or no close within the deadline: no figure
            return

    threading.Thread(target=run, daemon=True).start()
    return out


def wait_free(url: str, deadline_s: float, start: float, poll_s: float) -> float | None:
    """Seconds from `start` until the instance's KV cache usage reads 0; None past the deadline."""
    while time.perf_counter() - start < deadline_s:
        if kv_cache_usage(url) == 0.0:
            return time.perf_counter() - start
        time.sleep(poll_s)
    return None


def wait_scheduler_free(pair: Pair, since: float, deadline_s: float) -> dict[str, Any]:
    """scheduler_free, once its figure is there or `deadline_s` passed: for drills that read
    no gauge (--gauge-poll-ms 0), whose read would otherwise have waited for the free. Looks
    at the probe's file, on this machine, not at the instance."""
    end = time.perf_counter() + deadline_s
    while True:
        sched = scheduler_free(pair, since, deadline_s)
        if sched["free_s"] is not None or time.perf_counter() >= end or pair.decoder_probe is None:
            return sched
        time.sleep(PROBE_POLL_S)


def monotonic_s() -> float:
    """CLOCK_MONOTONIC, the system-wide clock the decoder's block probe stamps its frees with."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def scheduler_free(pair: Pair, since: float, deadline_s: float) -> dict[str, Any]:
    """When the decoder's scheduler had its blocks back after `since` (monotonic_s), from
    its block probe's log: {"free_s", "reason"}."""
    if pair.decoder_probe is None:
        return {"free_s": None, "reason": "no probe"}
    try:
        text: str | None = pair.decoder_probe.read_text()
    except FileNotFoundError:
        text = None
    return scheduler_free_after(text, since, deadline_s)


def run_this_thread_first() -> str:
    """Puts the calling thread under SCHED_FIFO where that is permitted, and says which
    policy it runs under. For the kill drill's killer: under the normal policy, on 2 cores
    busy with both instances, it was sometimes preempted between its stamp and its kill()
    (that call then returned 4-7 ms after the stamp, and the killed prefiller's sockets
    closed as late), which counted scheduling of this bench into the decoder's time."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "SCHED_FIFO"
    except (OSError, AttributeError) as e:
        return f"normal ({e.__class__.__name__}: real-time priority not permitted)"


def run_faults(pair: Pair, args: argparse.Namespace, prefill_s: float) -> dict[str, Any]:
    """Phase part 4: the client drops the decode leg mid-load; then the prefill instance is
    SIGKILLed mid-transfer. `prefill_s`: colocated TTFT of the drill's prompt length, to
    time the faults inside the hand-off."""
    d_url = pair.url(pair.decode)
    p_url = pair.url(pair.prefill)
    out: dict[str, Any] = {"fault_tokens": args.fault_tokens, "deadline_s": args.fault_deadline_s,
                           "gauge_poll_ms": args.gauge_poll_ms}
    d_text = metrics_text(d_url)
    d_counters0 = {k: prom_value(d_text, k) for k in CONNECTOR_COUNTERS}
    pulls = pair.config.kind == "nixl-pull"
    # Concurrent legs: the hand-off runs while the prefiller computes, so halfway through
    # its prefill is mid-transfer. Pull: the decoder reads after the prefill leg returned,
    # so the fault comes as the decode leg is sent.
    fault_delay_s = 0.0 if pulls else prefill_s / 2
    gauge_poll_s = args.gauge_poll_ms / 1000.0

    # (a) the client drops the decode leg mid-load
    body = body_of(prompt_of(args.fault_tokens, 424242), args.max_tokens, uuid.uuid4().hex)
    start = time.perf_counter()
    drop: dict[str, float] = {}

    def on_dropped() -> None:
        # Stamped as the client gives up, not after serve() waited for the prefill leg:
        # the decoder may free its blocks meanwhile.
        drop["at"], drop["monotonic"] = time.perf_counter(), monotonic_s()

    try:
        pair.serve(body, decode_read_timeout_s=max(0.02, fault_delay_s), on_dropped=on_dropped)
        out["abort"] = {"outcome": "completed before the client dropped it"}
    except httpx.ReadTimeout:
        dropped = drop.get("at", time.perf_counter())
        dropped_mono = drop.get("monotonic", monotonic_s())
        out["abort"] = {"outcome": "dropped", "dropped_after_s": dropped - start}
        if gauge_poll_s > 0:
            out["abort"]["usage_gauge_zero_s"] = wait_free(d_url, args.fault_deadline_s, dropped, gauge_poll_s)
            out["abort"]["prefiller_free_s"] = wait_free(p_url, args.fault_deadline_s, dropped, gauge_poll_s)
            # Read after the gauge showed 0 (or gave up): the scheduler freed before that.
            sched = scheduler_free(pair, dropped_mono, args.fault_deadline_s)
        else:
            sched = wait_scheduler_free(pair, dropped_mono, args.fault_deadline_s)
        out["abort"]["blocks_free_scheduler_s"] = sched["free_s"]
        out["abort"]["blocks_free_scheduler_reason"] = sched["reason"]
    except (httpx.HTTPError, RuntimeError) as e:
        out["abort"] = {"outcome": f"failed: {str(e)[:160]}"}

    # (b) SIGKILL of the prefill instance mid-transfer
    body = body_of(prompt_of(args.fault_tokens, 434343), args.max_tokens, uuid.uuid4().hex)
    killed: dict[str, float] = {}

    def kill_later() -> None:
        killed["killer_policy"] = run_this_thread_first()
        time.sleep(fault_delay_s)
        group = pair.fleet.instances[pair.prefill].process.pid  # its own process group
        # Stamped right before the signal, with no call between that releases the GIL: a
        # Popen.poll() there (os.waitpid) let this process's other threads take it, and the
        # signal went out up to a GIL switch interval (5 ms) after the stamp.
        killed["at"] = time.perf_counter()
        killed["monotonic"] = monotonic_s()  # the decoder's block probe stamps with this clock
        killed["unix"] = time.time()  # to line up with the instances' own log stamps
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:  # it had exited already: nothing was killed mid-transfer
            killed.clear()
            return
        killed["signal_sent_s"] = time.perf_counter() - killed["at"]

    killer = threading.Thread(target=kill_later, daemon=True)
    t_start = time.perf_counter()
    result: dict[str, Any] = {}
    free_watch = FreeWatch(d_url, args.fault_deadline_s + fault_delay_s + 10, gauge_poll_s).start() \
        if gauge_poll_s > 0 else None
    closed = watch_sockets_closed(pair.prefill_liveness, args.fault_deadline_s) if pair.prefill_liveness else {}

    def request() -> None:
        try:
            res = pair.serve(body, on_sent=killer.start, decode_read_timeout_s=args.fault_deadline_s)
            result["outcome"] = "completed (recomputed)" if res.token_ids else "completed"
            result["token_ids"] = res.token_ids
        except httpx.ReadTimeout:
            result["outcome"] = f"no answer within {args.fault_deadline_s:g} s"
        except (httpx.HTTPError, RuntimeError) as e:
            result["outcome"] = f"failed: {str(e)[:160]}"
        result["ended"] = time.perf_counter()

    req = threading.Thread(target=request, daemon=True)
    req.start()
    req.join(args.fault_deadline_s + fault_delay_s + 10)
    kill_at = killed.get("at", t_start)
    ended = result.get("ended")
    freed: dict[str, Any] = {"free_s": None, "resolution_ms": None}
    if free_watch is not None:
        free_watch.request_ended = ended if ended is not None else time.perf_counter()
        freed = free_watch.free_after(kill_at)
    sched = ((scheduler_free if free_watch is not None else wait_scheduler_free)(
                 pair, killed["monotonic"], args.fault_deadline_s) if "monotonic" in killed
             else {"free_s": None, "reason": "the prefiller was not killed"})
    kill_row = {"outcome": result.get("outcome", "no answer"), "killed_after_s": kill_at - t_start,
                "request_end_s": (ended - kill_at) if ended else None,
                "blocks_free_scheduler_s": sched["free_s"], "blocks_free_scheduler_reason": sched["reason"],
                **({"usage_gauge_zero_s": freed["free_s"], "usage_gauge_read_gap_ms": freed["resolution_ms"]}
                   if free_watch is not None else {})}
    if "unix" in killed:
        kill_row["killed_at_unix"] = killed["unix"]
        kill_row["signal_sent_s"] = killed.get("signal_sent_s")
        kill_row["killer_policy"] = killed.get("killer_policy")
    if "at" in closed:  # kvxfer only (the others have no liveness port to watch)
        kill_row["prefiller_sockets_closed_s"] = closed["at"] - kill_at
    if "token_ids" in result:
        kill_row["token_ids"] = result["token_ids"]
    out["kill_prefill"] = kill_row
    # Leaks: requests still held and what the decoder's connector counted (expired
    # requests, failed transfers) over both drills.
    d_text = metrics_text(d_url)
    out["decoder_after"] = {
        "kv_cache_usage": kv_cache_usage(d_url),
        "requests_running_or_waiting": prom_value(d_text, "vllm:num_requests_running")
        + prom_value(d_text, "vllm:num_requests_waiting"),
        **{k: prom_value(d_text, k) - d_counters0[k] for k in CONNECTOR_COUNTERS
           if "_count" not in k and "_sum" not in k and prom_value(d_text, k) - d_counters0[k]}}
    # Still serving after it all? (a decoder the fault broke would fail here)
    try:
        httpx.get(d_url + "/v1/models", headers=pair.fleet.headers, timeout=5).raise_for_status()
        out["decoder_alive_after"] = True
    except httpx.HTTPError:
        out["decoder_alive_after"] = False
    return out


def run_phase(config: Config, model: Path, work: Path, args: argparse.Namespace, peer_python: Path | None,
              spec_fields: dict[str, Any], colocated_ttft_at: dict[int, float]) -> dict[str, Any]:
    """One configuration: start its instances, run every part, stop them."""
    import psutil

    phase: dict[str, Any] = {"config": config.name, "kind": config.kind, "note": config.note}
    waited = time.monotonic()
    while psutil.virtual_memory().available < MEMORY_NEEDED_GIB * 2**30 and time.monotonic() - waited < MEMORY_WAIT_S:
        time.sleep(MEMORY_POLL_S)  # the machine is shared: other users' instances come and go
    try:
        _run_phase_on_fleet(phase, config, model, work, args, peer_python, spec_fields, colocated_ttft_at)
    except subprocess.TimeoutExpired as e:  # an instance outlived its stop: keep the figures, say so
        phase["stop_warning"] = f"an instance did not exit in time: {str(e)[:200]}"
    return phase


def _run_phase_on_fleet(phase: dict[str, Any], config: Config, model: Path, work: Path, args: argparse.Namespace,
                        peer_python: Path | None, spec_fields: dict[str, Any],
                        colocated_ttft_at: dict[int, float]) -> None:
    """run_phase's body: fills `phase` as it goes, so that a failure to stop keeps it."""
    from tqdm import tqdm

    kvxfer_extra = {"bind_host": "127.0.0.1", **args.kvxfer_extra}
    t0 = time.perf_counter()
    with VllmFleet(model, work / config.name.replace(" ", "-"), served_model_name="bench") as fleet:
        try:
            probe = (work / f"{config.name.replace(' ', '-')}-decoder-blocks.log"
                     if config.kind != "colocated" and not args.no_faults else None)
            pair = start_pair(config, fleet, peer_python, spec_fields, kvxfer_extra, args.request_timeout_s,
                              args.ready_timeout_s, decoder_probe=probe)
        except (PeerUnavailable, RuntimeError) as e:
            phase["unavailable"] = str(e) if isinstance(e, PeerUnavailable) else last_error_line(str(e))
            return
        phase["ready_s"] = time.perf_counter() - t0
        try:
            pair.serve(body_of(prompt_of(64, 99), 2, "warm-up"))  # first-request costs stay out of the figures
        except (httpx.HTTPError, RuntimeError) as e:
            logs = " | ".join(last_error_line(i.log_text()) for i in pair.instances())
            phase["unavailable"] = f"warm-up request failed ({str(e)[:160]}); logs: {logs}"
            return
        total = (len(args.lengths) * args.repeats + len(args.concurrency) * args.conc_requests
                 + args.conversations * args.turns)
        with tqdm(total=total, desc=config.name, unit="req", file=sys.stderr) as progress:
            phase["single"] = run_single(pair, args, progress)
            phase["concurrency"] = run_concurrency(pair, args, progress)
            phase["multi_turn"] = run_multi_turn(pair, args, progress)
        if config.kind != "colocated" and not args.no_faults:
            try:
                phase["faults"] = run_faults(pair, args, colocated_ttft_at.get(args.fault_tokens, 1.0))
            except Exception as e:  # a drill that breaks must not lose the phase's figures
                phase["faults"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        phase["wall_s"] = time.perf_counter() - t0


# ---- summary ---------------------------------------------------------------------------------

def ttft_by_prompt(rows: list[dict[str, Any]], key: tuple[str, ...]) -> dict[Any, float]:
    """TTFT of each successful row, keyed by the named fields."""
    return {tuple(r[k] for k in key): r["ttft_s"] for r in rows if "ttft_s" in r}


def outputs_equal(rows: list[dict[str, Any]], ref: list[dict[str, Any]], key: tuple[str, ...]) -> tuple[int, int]:
    """(rows whose text and token ids equal the colocated row of the same prompt, rows compared)."""
    ref_by = {tuple(r[k] for k in key): r for r in ref if "token_ids" in r}
    compared = equal = 0
    for r in rows:
        other = ref_by.get(tuple(r[k] for k in key))
        if other is None:
            continue
        compared += 1
        equal += r.get("token_ids") == other["token_ids"] and r.get("text") == other["text"]
    return equal, compared


def summarize(phases: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per configuration and length: medians, paired overheads, and the phase-wide figures."""
    colo = next((p for p in phases if p["kind"] == "colocated" and "single" in p), None)
    colo_rows = colo["single"]["rows"] if colo else []
    colo_turns = colo["multi_turn"] if colo else []
    colo_ttft = ttft_by_prompt(colo_rows, ("tokens", "rep"))
    out: dict[str, Any] = {"per_length": [], "per_config": []}
    for p in phases:
        if "single" not in p:
            out["per_config"].append({"config": p["config"], "unavailable": p.get("unavailable", "?")})
            continue
        rows = p["single"]["rows"]
        for n in args.lengths:
            mine = [r for r in rows if r["tokens"] == n and "ttft_s" in r]
            gaps = [g for r in mine for g in r["itl_s"]]
            tails = [r["transfer_s"] for r in mine if "transfer_s" in r]
            in_phase = {(r["tokens"], r["rep"]): r["colo_ttft_s"] for r in mine if "colo_ttft_s" in r}
            # Paired with the same prompt colocated on the pair's own prefill instance (same
            # phase); the colocated phase only where the pair measured none.
            over = (paired_overhead_s(ttft_by_prompt(mine, ("tokens", "rep")), in_phase or colo_ttft)
                    if p is not colo else None)
            out["per_length"].append({
                "config": p["config"], "tokens": n, "ok": len(mine),
                "failed": sum(1 for r in rows if r["tokens"] == n and "error" in r),
                "ttft_ms": statistics.median(r["ttft_s"] for r in mine) * 1e3 if mine else None,
                "colo_ttft_ms": statistics.median(in_phase.values()) * 1e3 if p is not colo and in_phase else None,
                # The overhead's two parts: the prefill leg's answer later than the same prompt
                # colocated (prefill slowed, or a pull's hand-over), and the first token after it.
                "prefill_leg_over_ms": _median_ms([r["prefill_leg_s"] - r["colo_ttft_s"] for r in mine
                                                   if "prefill_leg_s" in r and "colo_ttft_s" in r]),
                "after_prefill_leg_ms": _median_ms([r["ttft_s"] - r["prefill_leg_s"] for r in mine
                                                    if "prefill_leg_s" in r]),
                "overhead_ms": over * 1e3 if over is not None else None,
                "itl_ms": statistics.median(gaps) * 1e3 if gaps else None,
                "transfer_ms": statistics.median(tails) * 1e3 if tails else None,
                "transfer_what": next((r["transfer_what"] for r in mine if "transfer_what" in r), None)})
        eq, cmp_ = outputs_equal(rows, colo_rows, ("tokens", "rep"))
        eq_t, cmp_t = outputs_equal(p["multi_turn"], colo_turns, ("conversation", "turn"))
        later = [r for r in p["multi_turn"] if r["turn"] > 0 and "ttft_s" in r]
        turn_over = paired_overhead_s(ttft_by_prompt(later, ("conversation", "turn")),
                                      ttft_by_prompt(colo_turns, ("conversation", "turn"))) if p is not colo else None
        kv = p["single"].get("kv_bytes")
        colo_cpu = colo["single"]["cpu_s"] if colo else None
        cfg: dict[str, Any] = {
            "config": p["config"], "note": p["note"], "ready_s": p.get("ready_s"),
            "outputs_equal": f"{eq + eq_t}/{cmp_ + cmp_t}",
            "kv_gb": kv / 1e9 if kv else None,
            "cpu_s": p["single"]["cpu_s"],
            "cpu_s_per_gb": p["single"]["cpu_s"] / (kv / 1e9) if kv else None,
            "extra_cpu_s_per_gb": (p["single"]["cpu_s"] - colo_cpu) / (kv / 1e9) if kv and colo_cpu is not None else None,
            "goodput_rps": {c["concurrency"]: c["goodput_rps"] for c in p["concurrency"]},
            "conc_failed": sum(c["failed"] for c in p["concurrency"]),
            "multi_turn_ttft_ms": statistics.median(r["ttft_s"] for r in later) * 1e3 if later else None,
            "multi_turn_overhead_ms": turn_over * 1e3 if turn_over is not None else None,
            "multi_turn_failed": sum(1 for r in p["multi_turn"] if "error" in r)}
        f = p.get("faults")
        if f and "error" not in f:
            cfg["abort"] = f["abort"]
            cfg["kill"] = {k: v for k, v in f["kill_prefill"].items() if k != "token_ids"}
            cfg["decoder_alive_after"] = f["decoder_alive_after"]
            cfg["decoder_after"] = f.get("decoder_after")
            cfg["fault_deadline_s"] = f["deadline_s"]
        elif f:
            cfg["fault_error"] = f["error"]
        out["per_config"].append(cfg)
    out["goals"] = goal_verdicts(out, args)
    return out


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def goal_verdicts(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Issue 30's goals, met or not, against the best peer that ran."""
    lines = []
    kvx = [c for c in summary["per_config"] if c["config"].startswith("kvxfer") and "unavailable" not in c]
    peers = [c for c in summary["per_config"] if c["config"].split()[0] in ("NIXL", "Mooncake")
             and "unavailable" not in c]
    if not kvx or not peers:
        return ["goals: no kvxfer or no peer configuration ran; nothing to compare"]
    for k in kvx:
        for n in [n for n in args.lengths if n >= 1024]:
            mine = next(r["overhead_ms"] for r in summary["per_length"] if r["config"] == k["config"] and r["tokens"] == n)
            theirs = [r["overhead_ms"] for r in summary["per_length"]
                      if r["tokens"] == n and r["config"] in {p["config"] for p in peers}]
            ratio = ratio_to_best_peer(mine, theirs, lower_is_better=True)
            verdict = "n/a" if ratio is None else ("met" if ratio <= 0.5 else "NOT met")
            lines.append(f"{k['config']}: overhead at {n} tokens {fmt(mine)} ms vs best peer "
                         f"{fmt(min((t for t in theirs if t is not None), default=None))} ms: "
                         f"{fmt(ratio, '.2f')}x (goal <= 0.5x) -> {verdict}")
        if args.concurrency:
            c8 = max(args.concurrency)
            ratio = ratio_to_best_peer(k["goodput_rps"].get(c8), [p["goodput_rps"].get(c8) for p in peers],
                                       lower_is_better=False)
            verdict = "n/a" if ratio is None else ("met" if ratio >= 1.2 else "NOT met")
            lines.append(f"{k['config']}: goodput at concurrency {c8}: {fmt(ratio, '.2f')}x the best peer's "
                         f"(goal >= 1.2x) -> {verdict}")
        # The scheduler's free is the goal's figure; the gauge read, the same for every
        # connector's lag included, is shown beside it.
        killed = [p for p in peers if p.get("kill")]
        for what, key in (("scheduler", "blocks_free_scheduler_s"), ("usage gauge read 0", "usage_gauge_zero_s")):
            if key == "blocks_free_scheduler_s":
                # A figure the probe could not give (not loaded) is neither a time nor a lower
                # bound: comparing with the other peers only could flatter the ratio.
                unknown = [c["config"] for c in [k, *killed] if c.get("kill") and c["kill"].get(key) is None
                           and "probe" in str(c["kill"].get("blocks_free_scheduler_reason"))]
                if unknown:
                    lines.append(f"{k['config']}: decoder blocks free (scheduler): no verdict, no probe figure for "
                                 f"{', '.join(unknown)}")
                    continue
            line = ratio_line(k["config"], what, (k.get("kill") or {}).get(key),
                              [p["kill"].get(key) for p in killed], args.fault_deadline_s)
            if line:
                lines.append(line)
    return lines


def fmt(v: float | None, spec: str = ".0f") -> str:
    """A number or '-'."""
    return "-" if v is None else format(v, spec)


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The tables as text (markdown), printed and returned for the JSON."""
    lines = ["| configuration | tokens | TTFT ms | same prompts colocated on its prefill instance, TTFT ms | "
             "overhead ms (paired median) | of which: prefill leg later ms, first token after it ms | ITL ms | "
             "transfer ms (what) | ok/failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["per_length"]:
        lines.append(f"| {r['config']} | {r['tokens']} | {fmt(r['ttft_ms'])} | {fmt(r['colo_ttft_ms'])} | "
                     f"{fmt(r['overhead_ms'], '+.0f')} | {fmt(r.get('prefill_leg_over_ms'), '+.0f')}, "
                     f"{fmt(r.get('after_prefill_leg_ms'))} | "
                     f"{fmt(r['itl_ms'], '.1f')} | {fmt(r['transfer_ms'], '.1f')} {('(' + r['transfer_what'] + ')') if r['transfer_what'] else ''} | "
                     f"{r['ok']}/{r['failed']} |")
    conc = "".join(f" goodput c={c} req/s |" for c in args.concurrency)
    lines += ["", f"| configuration | outputs equal | KV GB | CPU s/GB (extra over colocated) |{conc} "
              "multi-turn TTFT ms (overhead) | abort: decoder blocks free (scheduler) s, usage gauge read 0 s | "
              "kill: request end s | kill: decoder blocks free (scheduler) s | kill: usage gauge read 0 s |",
              "|---|---|---:|---:|" + "---:|" * len(args.concurrency) + "---:|---|---|---|---|"]
    for c in summary["per_config"]:
        if "unavailable" in c:
            lines.append(f"| {c['config']} | not run: {c['unavailable']} |" + " |" * (7 + len(args.concurrency)))
            continue
        gp = "".join(f" {c['goodput_rps'].get(k, 0):.2f} |" for k in args.concurrency)
        if c.get("conc_failed"):
            gp = gp[:-1] + f"({c['conc_failed']} failed) |"
        ab, kl = c.get("abort") or {}, c.get("kill") or {}
        deadline = c.get("fault_deadline_s", args.fault_deadline_s)
        if ab.get("outcome") == "dropped":
            gauge = "not read" if "usage_gauge_zero_s" not in ab else \
                fmt(ab["usage_gauge_zero_s"], ".3f") if ab["usage_gauge_zero_s"] is not None else f"> {deadline:g}"
            abort = f"{free_cell(ab.get('blocks_free_scheduler_s'), ab.get('blocks_free_scheduler_reason'))}, {gauge}"
        else:
            abort = ab.get("outcome") or "-"
        if kl:
            kill = (f"{fmt(kl.get('request_end_s'), '.2f')} ({kl.get('outcome', '-')}) | "
                    f"{free_cell(kl.get('blocks_free_scheduler_s'), kl.get('blocks_free_scheduler_reason'))} | "
                    + (gauge_cell(kl.get('usage_gauge_zero_s'), kl.get('usage_gauge_read_gap_ms'), deadline)
                       if "usage_gauge_zero_s" in kl else "not read"))
        else:
            kill = c.get("fault_error", "-")[:80] + " | - | -"
        lines.append(f"| {c['config']} | {c['outputs_equal']} | {fmt(c['kv_gb'], '.3f')} | "
                     f"{fmt(c['cpu_s_per_gb'], '.1f')} ({fmt(c['extra_cpu_s_per_gb'], '+.1f')}) |{gp} "
                     f"{fmt(c['multi_turn_ttft_ms'])} ({fmt(c['multi_turn_overhead_ms'], '+.0f')}) | {abort} | {kill} |")
    text = "\n".join(lines + [""] + summary["goals"])
    print("\n" + text)
    return text


def plot(summary: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    """TTFT overhead by prompt length per configuration, goodput by concurrency, and the kill
    drill's decoder free: the scheduler's (block probe) beside the usage gauge's read."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for c in summary["per_config"]:
        if "unavailable" in c or c["config"] == "vllm colocated":
            continue
        pts = [(r["tokens"], r["overhead_ms"]) for r in summary["per_length"]
               if r["config"] == c["config"] and r["overhead_ms"] is not None]
        ax1.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=c["config"])
        ax2.plot(args.concurrency, [c["goodput_rps"].get(k, 0) for k in args.concurrency], marker="o",
                 label=c["config"])
    colo = next((c for c in summary["per_config"] if c["config"] == "vllm colocated" and "unavailable" not in c), None)
    if colo:
        ax2.plot(args.concurrency, [colo["goodput_rps"].get(k, 0) for k in args.concurrency], marker="o",
                 color="gray", linestyle="--", label="vllm colocated")
    ax1.set(xlabel="prompt tokens", ylabel="TTFT - colocated TTFT (ms, paired median)", xscale="log",
            title="disaggregation overhead")
    ax2.set(xlabel="concurrency", ylabel=f"goodput (req/s, TTFT <= {args.ttft_bound_s:g} s)",
            title=f"{args.conc_tokens}-token prompts")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    killed = [c for c in summary["per_config"] if c.get("kill")]
    xs = range(len(killed))
    # A missing figure (no probe, never freed) is drawn as no bar, never as a number.
    sched = [(c["kill"].get("blocks_free_scheduler_s") or math.nan) * 1e3 for c in killed]
    gauge = [(c["kill"].get("usage_gauge_zero_s") or math.nan) * 1e3 for c in killed]
    ax3.bar([x - 0.2 for x in xs], sched, width=0.4, label="decoder blocks free (scheduler)")
    ax3.bar([x + 0.2 for x in xs], gauge, width=0.4, label="usage gauge read 0")
    ax3.set_xticks(list(xs), [c["config"] for c in killed], rotation=20, fontsize=7)
    # Log scale only with a bar to draw: a run whose every decoder missed the deadline has none.
    drawn = any(not math.isnan(v) for v in sched + gauge)
    ax3.set(ylabel="ms after SIGKILL of the prefiller", yscale="log" if drawn else "linear",
            title="kill drill: decoder blocks free")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    """The command line."""
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in minutes: prompts of 128 and 1024 tokens, 2 repeats, 4 requests per "
                        "concurrency, one 3-turn conversation (each flag given explicitly still wins)")
    p.add_argument("--configs", type=lambda s: s.split(","),
                   help="configurations to run, comma-separated, by name: "
                        + ", ".join(f"'{c.name}'" for c in CONFIGS) + " (default: all; colocated always runs)")
    p.add_argument("--install-peers", action="store_true",
                   help="create .bench-venvs/vllm-peers (this python, .venv's packages through a .pth) and pip "
                        "install nixl and mooncake there with --no-deps if missing; never touches .venv")
    p.add_argument("--lengths", type=ints, help="prompt lengths in tokens (default 128,512,1024,2048,4096)")
    p.add_argument("--repeats", type=int, help="requests per prompt length and configuration (default 20)")
    p.add_argument("--max-tokens", type=int, default=8,
                   help="tokens generated per request (greedy, ignore_eos); ITL comes from their gaps (default 8)")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 8], help="client concurrencies (default 1,4,8)")
    p.add_argument("--conc-requests", type=int, help="requests per concurrency level (default 16)")
    p.add_argument("--conc-tokens", type=int, default=512, help="prompt length of the concurrency runs (default 512)")
    p.add_argument("--ttft-bound-s", type=float, default=5.0,
                   help="a request counts for goodput if its TTFT is within this many seconds (default 5.0)")
    p.add_argument("--conversations", type=int, help="multi-turn conversations (default 3)")
    p.add_argument("--turns", type=int, help="turns per conversation (default 4)")
    p.add_argument("--turn-tokens", type=int, default=256, help="new prompt tokens per turn (default 256)")
    p.add_argument("--fault-tokens", type=int, default=4096,
                   help="prompt length of the fault drills; must be one of --lengths (default 4096; --quick 1024)")
    p.add_argument("--fault-deadline-s", type=float, default=60.0,
                   help="how long a drill waits for the decoder's request to end and its blocks to free; "
                        "longer shows as '> N' (default 60)")
    p.add_argument("--no-faults", action="store_true",
                   help="skip the fault drills (and the decode instances' block probe). The drills report, per "
                        "configuration, 'decoder blocks free (scheduler)': seconds from the fault (SIGKILL of the "
                        "prefiller, or the client dropping the decode leg) until the decode instance's scheduler "
                        "had every block back, recorded in its EngineCore by benchmarks/probes/sitecustomize.py "
                        "(on the decode instance's PYTHONPATH, any connector); the goal's ratio uses it. Beside "
                        "it 'usage gauge read 0': until a read of /metrics showed vllm:kv_cache_usage_perc 0, "
                        "later by the API server's stats update and the read itself, with the gap to the read "
                        "before ('gap N ms'). '-' with a reason: no figure (probe not loaded, pool never back "
                        "at idle); '> N': not within --fault-deadline-s")
    p.add_argument("--gauge-poll-ms", type=float, default=GAUGE_POLL_MS,
                   help="pause between two reads of an instance's /metrics while a drill waits for its blocks to "
                        "free, for 'usage gauge read 0'. Each read takes milliseconds of the instance's own core "
                        "(vLLM renders every metric), so a short pause competes with the decoder being timed; the "
                        "scheduler's figure does not need these reads. 0: no reads, no gauge figure "
                        "(default %(default)g)")
    p.add_argument("--faults-only", action="store_true",
                   help="the fault drills only: no concurrency runs, no multi-turn conversations; each configuration "
                        "still serves --lengths x --repeats single requests first (give --lengths N --repeats 1 "
                        "with N the --fault-tokens: the colocated TTFT times the faults)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="client timeout of one request (default 600)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0,
                   help="how long a configuration's instances may take to serve (default 600)")
    p.add_argument("--kvxfer-extra", type=json.loads, default={},
                   help="more kv_connector_extra_config settings for the kvxfer instances, as JSON (default none)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_connectors",
                   help="output stem: OUT.json and OUT.png (default benchmarks/results/vllm_connectors)")
    a = p.parse_args()
    quick = a.quick
    a.lengths = a.lengths or ([128, 1024] if quick else [128, 512, 1024, 2048, 4096])
    a.repeats = a.repeats or (2 if quick else 20)
    a.conc_requests = a.conc_requests or (4 if quick else 16)
    a.conversations = a.conversations or (1 if quick else 3)
    a.turns = a.turns or (3 if quick else 4)
    if a.faults_only:
        if a.no_faults:
            p.error("--faults-only and --no-faults exclude each other")
        a.concurrency, a.conversations = [], 0
    if quick and "--fault-tokens" not in sys.argv:
        a.fault_tokens = 1024
    if a.fault_tokens not in a.lengths:
        p.error("--fault-tokens must be one of --lengths (its colocated TTFT times the faults)")
    names = {c.name for c in CONFIGS}
    if a.configs and set(a.configs) - names:
        p.error(f"unknown configurations {sorted(set(a.configs) - names)}; known: {sorted(names)}")
    return a


def main() -> None:
    args = parse_args()
    configs = [c for c in CONFIGS if c.kind == "colocated" or not args.configs or c.name in args.configs]
    model = make_checkpoint(Path(tempfile.gettempdir()) / "kvxfer-bench-llama-8l-8kv-128d", SHAPE)
    work = Path(tempfile.mkdtemp(prefix="kvxfer-bench-connectors-"))
    longest = max(max(args.lengths), args.conc_tokens,
                  args.conversations and args.turns * (args.turn_tokens + args.max_tokens))
    max_model_len = longest + args.max_tokens + 64
    # One chunk per prompt: every configuration computes a prompt the same way.
    spec_fields = {"max_model_len": max_model_len, "max_num_batched_tokens": max_model_len, "kv_cache_gib": 1.0}
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    peer_python: Path | None = None
    peer_error = ""
    if any(c.kind not in ("colocated", "kvxfer") for c in configs):
        try:
            peer_python = ensure_peer_env(args.install_peers)
        except (PeerUnavailable, OSError, subprocess.SubprocessError) as e:
            peer_error = str(e)
    print(f"model {model} ({KV_BYTES_PER_TOKEN // 1024} KiB KV per token); logs under {work}", flush=True)
    phases: list[dict[str, Any]] = []
    colocated_ttft_at: dict[int, float] = {}
    for i, config in enumerate(configs):
        print(f"phase {i + 1}/{len(configs)}: {config.name}", flush=True)
        if peer_error and config.kind not in ("colocated", "kvxfer"):
            phases.append({"config": config.name, "kind": config.kind, "note": config.note,
                           "unavailable": peer_error})
            continue
        phase = run_phase(config, model, work, args, peer_python, spec_fields, colocated_ttft_at)
        if config.kind == "colocated" and "single" in phase:
            for n in args.lengths:
                ts = [r["ttft_s"] for r in phase["single"]["rows"] if r["tokens"] == n and "ttft_s" in r]
                if ts:
                    colocated_ttft_at[n] = statistics.median(ts)
        if "unavailable" in phase:
            print(f"  not run: {phase['unavailable']}", flush=True)
        phases.append(phase)
        # What is measured so far, after every phase: a run cut short keeps it.
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps({
            "command": " ".join(sys.argv), "phases": phases, "load_average": os.getloadavg()}, indent=1))
    summary = summarize(phases, args)
    table = print_tables(summary, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({
        "command": " ".join(sys.argv), "model": str(model), "shape": SHAPE.__dict__,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "ttft_bound_s": args.ttft_bound_s,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary, "table": table, "phases": phases,
        "load_average_at_end": os.getloadavg(), "cpus": os.cpu_count()}, indent=1))
    plot(summary, args, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and .png; instance logs under {work}")


if __name__ == "__main__":
    main()
