"""Fault injection over the fabric, in pods: real prefill and decode processes, each in a
network and PID namespace of its own on one bridge (tests/support/pod_namespaces.py), so
the KV crosses libfabric as between Kubernetes pods; where namespaces cannot be made, plain
processes on loopback with the same-host path off. One faulty prefiller per test (its push
hooks from support.push_faults) beside a healthy one. The freeze comes from outside: the test
SIGSTOPs the pod's PID 1 from the host (a PID 1 ignores a SIGSTOP it sends itself).

Each fault must end in a clear error within its deadline, leak no page on any worker,
leave a healthy request running beside it exact (its landed KV's digest equals the
colocated reference's), and write nothing into pages handed to another request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.kv_requests import (
    CONFIG,
    DIGEST_ENV,
    MAX_TOKENS,
    check_against_reference,
    disaggregated,
    generate_call,
    prefill_call,
    reference,
    reserve,
    text_prompt,
    tokens_of,
    wait_pages_full,
)
from support.pod_cluster import pod_worker_set
from support.push_faults import fault_env
from support.waiting import wait_until
from support.worker_procs import WorkerProc, WorkerSet

pytestmark = pytest.mark.timeout(240)

FABRIC = {"KVXFER_SAME_HOST": "false"}
FENCE_S = 3.0
TRANSFER_S = 2.0  # the prefillers' transfer_timeout_s: a push may stall FENCE_S - TRANSFER_S = 1 s
GEN_TIMEOUT_S = 1.5  # the faulty request's KV wait deadline
PREFILL_ENV = {**FABRIC, "KVXFER_TRANSFER_TIMEOUT_S": str(TRANSFER_S)}
PROMPT = 300  # tokens: 19 pages per layer, one 256-token chunk then one more


@pytest.fixture(scope="module")
def pod_set(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[WorkerSet]:
    """The module's workers, pods of one network; the tests run on its bridge."""
    with pod_worker_set(tmp_path_factory.mktemp("fault_workers"), request, "module") as workers:
        yield workers


@pytest.fixture(scope="module")
def fabric_pair(pod_set: WorkerSet) -> dict[str, WorkerProc]:
    """A decode worker (full integrity, receipt digests) and a healthy prefiller, fabric only."""
    decode, healthy = pod_set.start_many([
        ("decode", {"env": {**FABRIC, **DIGEST_ENV, "KVXFER_FENCE_TIMEOUT_S": str(FENCE_S),
                            "KVXFER_KV_INTEGRITY": "full"}}),
        ("prefill", {"env": PREFILL_ENV}),
    ])
    return {"decode": decode, "healthy": healthy}


@pytest.fixture
def own_workers(pod_set: WorkerSet) -> Iterator[WorkerSet]:
    """Workers of one test on the module's network; killed when the test ends."""
    first = len(pod_set.procs)
    yield pod_set
    for proc in pod_set.procs[first:]:
        proc.kill()


def faulty_prefiller(own_workers: WorkerSet, spec: str) -> WorkerProc:
    return own_workers.start("prefill", env={**PREFILL_ENV, **fault_env(spec)})


def metric(worker: WorkerProc, name: str) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def faulty_flow(client: httpx.AsyncClient, decode: WorkerProc, faulty: WorkerProc, rid: str,
                      prompt: list[int]) -> tuple[int, dict[str, Any], float, httpx.Response]:
    """Reserve, then the faulty /prefill beside /generate with GEN_TIMEOUT_S; returns the
    /generate status, body, seconds to its answer, and the /prefill response."""
    reservation = await reserve(client, decode, rid, prompt)
    t0 = time.monotonic()
    gen = asyncio.create_task(generate_call(client, decode, rid, stream=False, timeout_s=GEN_TIMEOUT_S))
    pre = asyncio.create_task(prefill_call(client, faulty, rid, prompt, reservation))
    status, body = await gen
    elapsed = time.monotonic() - t0
    return status, body, elapsed, await pre


def run_beside_healthy(pair: dict[str, WorkerProc], faulty: WorkerProc, name: str) -> tuple[int, dict[str, Any], float, httpx.Response]:
    """The faulty request and a healthy one at once; the healthy one must be exact."""
    decode, healthy = pair["decode"], pair["healthy"]
    wait_pages_full(decode, timeout_s=FENCE_S + 5)
    bad, good = tokens_of(text_prompt(700, PROMPT)), tokens_of(text_prompt(701, 200))
    reference(good)

    async def run() -> tuple[Any, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(faulty_flow(client, decode, faulty, f"{name}-bad", bad),
                                        disaggregated(client, decode, healthy, f"{name}-good", good))

    bad_result, (reservation, pre, gen) = asyncio.run(run())
    check_against_reference(f"{name}-good", good, reservation, pre, gen)
    return bad_result


def assert_nothing_leaked(*workers: WorkerProc) -> None:
    for worker in workers:
        wait_pages_full(worker, timeout_s=FENCE_S + 5)


def test_skipped_page_fails_at_the_kv_deadline_and_the_pages_come_back(fabric_pair: dict[str, WorkerProc],
                                                                        own_workers: WorkerSet) -> None:
    faulty = faulty_prefiller(own_workers, "skip_page:0")
    status, body, elapsed, _ = run_beside_healthy(fabric_pair, faulty, "skip")
    assert status == 504 and "writes landed" in body["detail"], body
    assert elapsed < GEN_TIMEOUT_S + 1.0, f"answered after {elapsed:.2f} s"
    assert_nothing_leaked(fabric_pair["decode"], fabric_pair["healthy"], faulty)


def test_page_sent_twice_is_refused_before_admission(fabric_pair: dict[str, WorkerProc], own_workers: WorkerSet) -> None:
    faulty = faulty_prefiller(own_workers, "duplicate_page:0")
    status, body, elapsed, _ = run_beside_healthy(fabric_pair, faulty, "dup")
    # The count completes one write early: the mailbox (the last write) is not there yet, or
    # the count already shows one write too many.
    assert status == 502 and body.get("reason") == "integrity", body
    assert "mailbox_mismatch" in body["detail"] or "write_overcount" in body["detail"], body
    assert elapsed < GEN_TIMEOUT_S, f"answered after {elapsed:.2f} s"
    assert_nothing_leaked(fabric_pair["decode"], fabric_pair["healthy"], faulty)


def test_flipped_bit_fails_the_checksum_and_is_counted(fabric_pair: dict[str, WorkerProc], own_workers: WorkerSet) -> None:
    decode = fabric_pair["decode"]
    before = metric(decode, 'kvxfer_decode_kv_integrity_failures_total{reason="checksum_mismatch"}')
    faulty = faulty_prefiller(own_workers, "flip_bit:1")
    status, body, elapsed, pre = run_beside_healthy(fabric_pair, faulty, "flip")
    assert pre.status_code == 200, pre.text  # the prefiller does not know: only the check can tell
    assert status == 502 and "checksum_mismatch" in body["detail"] and "layer 1" in body["detail"], body
    assert elapsed < GEN_TIMEOUT_S, f"answered after {elapsed:.2f} s"
    assert metric(decode, 'kvxfer_decode_kv_integrity_failures_total{reason="checksum_mismatch"}') == before + 1
    assert_nothing_leaked(decode, fabric_pair["healthy"], faulty)


def test_late_writer_stops_itself_instead_of_writing_into_reused_pages(fabric_pair: dict[str, WorkerProc],
                                                                       own_workers: WorkerSet) -> None:
    # Stands still 2.5 s before layer 1: past the decoder's KV deadline (1.5 s) and past
    # the 1 s a push may stall (fence 3 s - transfer deadline 2 s).
    faulty = faulty_prefiller(own_workers, "write_late:2500")
    status, body, elapsed, pre = run_beside_healthy(fabric_pair, faulty, "late")
    assert status == 504 and elapsed < GEN_TIMEOUT_S + 1.0, (status, body, elapsed)
    assert pre.status_code == 502 and "stalled" in pre.text, pre.text
    # Requests after it (on pages it held) are exact.
    followers = {f"late-after-{i}": tokens_of(text_prompt(710 + i, PROMPT)) for i in range(2)}

    async def run() -> list[Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            return [await disaggregated(client, fabric_pair["decode"], fabric_pair["healthy"], rid, p)
                    for rid, p in followers.items()]

    for (rid, prompt), (reservation, pre2, gen) in zip(followers.items(), asyncio.run(run())):
        check_against_reference(rid, prompt, reservation, pre2, gen)
    assert_nothing_leaked(fabric_pair["decode"], fabric_pair["healthy"], faulty)


def test_frozen_prefiller_resumed_after_reuse_writes_nothing(fabric_pair: dict[str, WorkerProc],
                                                             own_workers: WorkerSet) -> None:
    healthy = fabric_pair["healthy"]
    # A pool of one request's pages and 4 more: the next request must take the frozen one's.
    pages = -(-(PROMPT + MAX_TOKENS) // CONFIG.block_size) + 4
    decode, faulty = own_workers.start_many([
        ("decode", {"num_pages": pages, "env": {**FABRIC, **DIGEST_ENV, "KVXFER_FENCE_TIMEOUT_S": str(FENCE_S)}}),
        ("prefill", {"env": {**PREFILL_ENV, **fault_env("freeze_after_layer:1")}}),
    ])
    bad = tokens_of(text_prompt(720, PROMPT))
    nxt = tokens_of(text_prompt(721, PROMPT))
    wait_pages_full(decode, timeout_s=FENCE_S + 5)
    total = httpx.get(f"{decode.url}/info", timeout=5).json()["total_pages"]

    async def run() -> tuple[Any, Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            reservation = await reserve(client, decode, "frozen", bad)
            pre = asyncio.create_task(prefill_call(client, faulty, "frozen", bad, reservation))
            t0 = time.monotonic()
            status, body = await generate_call(client, decode, "frozen", stream=False, timeout_s=GEN_TIMEOUT_S)
            elapsed = time.monotonic() - t0
            assert status == 504 and elapsed < GEN_TIMEOUT_S + 1.0, (status, body, elapsed)
            # At its freeze point (no write in flight), the test stops it from outside.
            await asyncio.to_thread(wait_until, lambda: "frozen point before layer" in faulty.log_text(), 5,
                                    "the prefiller at its freeze point")
            faulty.freeze()
            # The fence passes (nobody vouched for the frozen writer): the pages are free again...
            await asyncio.to_thread(wait_pages_full, decode, FENCE_S + 5)
            # ...and go to the next request, whose KV lands; then the frozen prefiller wakes.
            res2 = await reserve(client, decode, "next", nxt)
            assert set(res2["pages"]) & set(reservation["pages"]), "the next request did not get the frozen one's pages"
            pre2 = await prefill_call(client, healthy, "next", nxt, res2)
            faulty.thaw()
            frozen_pre = await pre
            gen2 = await generate_call(client, decode, "next", stream=False)
            return (res2, pre2, gen2), frozen_pre

    (res2, pre2, gen2), frozen_pre = asyncio.run(run())
    assert frozen_pre.status_code == 502 and "stalled" in frozen_pre.text, frozen_pre.text
    check_against_reference("next", nxt, res2, pre2, gen2)  # by bytes: nothing of "frozen" landed
    assert_nothing_leaked(decode, healthy, faulty)
    assert httpx.get(f"{decode.url}/info", timeout=5).json()["total_pages"] == total
