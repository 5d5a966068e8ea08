"""The builtin decoder's cancel of one request leaves another request's writes from the
same prefiller alone, and frees the cancelled request's pages only once none of its
writes can land (kvxfer/workers/decode/job_table.py, the ledger's `keep_writes_open`).

libfabric's net provider refuses an op whose header names a revoked registration by
dropping the whole connection: every write queued behind it to that peer, another
request's too, then fails ("Transport endpoint is not connected"). So a cancelled
reservation keeps its registration open until its prefiller confirms that none of its
writes is in flight (then revoked and freed), or `cancel_confirm_timeout_s` passes (then
revoked, and freed at `fence_timeout_s`, as before).

The decoder is a `DecodeService` in this process (its engine on loopback, the same-host
path off); the prefiller is a child process with an engine of its own (`python <this
file>`, `_writer_main`) that writes two reservations' pages and mailbox as a prefiller
does, many MiB of both queued on its one connection, with seeded bytes the test compares.
"""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.errors import TransferError
from kvxfer.handoff.decode_ledger import DeadlineSetting
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.protocol import KVReservation, encode_mailbox
from kvxfer.kv.write_windows import page_runs
from kvxfer.transfer.engine import TransferEngine
from kvxfer.workers.decode.job import DecodePhase
from kvxfer.workers.decode.service import DecodeService, DecodeSettings

pytestmark = pytest.mark.timeout(120)

PROMPT_TOKENS = 1000  # 63 pages of the tiny model per layer: a 252 KiB window per layer
NUM_PAGES = 2 * 64
#: Rounds of every layer's whole window, for both requests, posted before the cancel and
#: after it: tens of MiB of both queued on the one connection when the cancel comes.
ROUNDS_BEFORE, ROUNDS_AFTER = 48, 16
SEED = 4242
#: The first token the writer puts in a mailbox; with max_tokens 1 the request ends there.
FIRST_TOKEN = ord("k")
DEADLINE_S = 60.0


def _decoder(**settings: Any) -> DecodeService:
    return DecodeService(DecodeSettings(model="tiny", provider="net", bind_host="127.0.0.1", same_host=False,
                                        num_pages=NUM_PAGES, max_requests=4, kv_integrity="off", prefix_cache=False,
                                        **settings))


def _source(num_bytes: int) -> np.ndarray:
    """The seeded bytes the writer sends, laid out like the decoder's cache."""
    return np.random.default_rng(SEED).integers(0, 256, num_bytes, dtype=np.uint8)


class Writer:
    """The prefiller: a child process with its own engine, told what to write on stdin, its
    progress read from its stdout (each read with a deadline)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.send(json.dumps(spec))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"the writer did not say {word!r} within {timeout_s} s") from None
        said = json.loads(line)
        assert said["said"] == word, said
        return said

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    """Writer processes a test started: killed at teardown."""
    started: list[Writer] = []
    try:
        yield started
    finally:
        for writer in started:
            writer.close()


def _target(res: KVReservation) -> dict[str, Any]:
    """What the writer needs of a reservation (JSON)."""
    return {"descriptor": res.descriptor.hex(), "meta_descriptor": res.meta_descriptor.hex(),
            "meta_offset": res.meta_offset, "imm": res.imm, "nonce": res.nonce, "pages": res.pages}


def _holds(decode: DecodeService, src: np.ndarray, pages: list[int]) -> bool:
    """Whether the decoder's cache holds the source's bytes at `pages`, in every layer."""
    page_bytes = decode.core.cache.page_bytes
    got = decode.core.cache.tensor.numpy().view(np.uint8).ravel()
    return all(np.array_equal(got[o:o + page_bytes], src[o:o + page_bytes]) for o in _page_offsets(decode, pages))


def _page_offsets(decode: DecodeService, pages: list[int]) -> list[int]:
    cache = decode.core.cache
    return [(layer * cache.num_pages + page) * cache.page_bytes
            for layer in range(decode.core.config.num_layers) for page in pages]


def test_a_cancel_keeps_another_requests_writes_on_the_same_connection_and_frees_after_the_confirmation(
        writers: list[Writer]) -> None:
    decode = _decoder()
    try:
        cache = decode.core.cache
        src = _source(cache.num_pages * cache.page_bytes * decode.core.config.num_layers)
        res = {r: decode.reserve(r, PROMPT_TOKENS, 1) for r in ("a", "b")}
        job_b = decode.job("b")
        writer = Writer({
            "num_pages": cache.num_pages, "page_bytes": cache.page_bytes, "num_layers": decode.core.config.num_layers,
            "prompt_tokens": PROMPT_TOKENS, "rounds_before": ROUNDS_BEFORE, "rounds_after": ROUNDS_AFTER,
            "targets": {r: _target(reservation) for r, reservation in res.items()}})
        writers.append(writer)
        posted = writer.expect("posted", DEADLINE_S)
        # The router's /cancel of A reaches the decoder while both requests' writes are
        # queued on the writer's one connection (and it asks the prefiller to stop).
        assert decode.cancel("a")["state"] == Res.FENCED.value
        entry_a = decode.ledger.get("a")
        assert entry_a is not None and entry_a.deadline_setting is DeadlineSetting.CANCEL_CONFIRM
        free_after_cancel = decode.allocator.free_pages
        writer.send("go")  # the prefiller goes on writing A until it reads its cancel
        done = writer.expect("done", DEADLINE_S)
        assert done["b"]["failed"] == 0, f"B's writes failed: {done['b']['first_error']}"
        assert done["a"]["failed"] == 0, f"A's writes failed: {done['a']['first_error']}"
        assert decode.core.engine.imm_count(res["b"].imm) == job_b.expected_count
        assert _holds(decode, src, res["b"].pages), "B's pages differ from what was written"
        # Until the prefiller's word A stays fenced: none of its pages went back.
        assert decode.ledger.get("a") is entry_a and entry_a.state is Res.FENCED
        assert decode.allocator.free_pages == free_after_cancel

        # B is admitted and ends at its first token (max_tokens 1).
        asyncio.run(decode.wait_for_kv(job_b, DEADLINE_S))
        assert job_b.phase is DecodePhase.DONE and job_b.kept == [FIRST_TOKEN]
        # The prefiller answers in_flight false; the router relays it: A is revoked and freed.
        assert decode.cancel("a", prefill_stopped=True)["state"] == Res.FREE.value
        assert decode.ledger.get("a") is None
        assert decode.allocator.free_pages == decode.allocator.total_pages
        with TransferEngine("net", same_host=False, bind_host="127.0.0.1", transfer_timeout_s=5.0) as outsider:
            one_page = outsider.register(np.zeros(cache.page_bytes, dtype=np.uint8))
            with pytest.raises(TransferError):
                offset = _page_offsets(decode, res["a"].pages[:1])[0]
                outsider.write(one_page, 0, res["a"].descriptor, offset, cache.page_bytes).wait(10)
        print(f"writes posted before the cancel: {posted['writes']} ({posted['mib']:.0f} MiB of both requests)")
    finally:
        decode.close()


def test_a_cancel_never_confirmed_is_revoked_at_its_bound_and_freed_after_the_fence() -> None:
    fence_s, bound_s = 2.0, 0.5
    decode = _decoder(fence_timeout_s=fence_s, cancel_confirm_timeout_s=bound_s, revoke_grace_s=1.0)
    try:
        cache = decode.core.cache
        res = decode.reserve("c", PROMPT_TOKENS, 1)
        decode.cancel("c")
        entry = decode.ledger.get("c")
        assert entry is not None and entry.deadline_setting is DeadlineSetting.CANCEL_CONFIRM
        fenced_at = entry.history[-1][1]
        offset = _page_offsets(decode, res.pages[:1])[0]
        with TransferEngine("net", same_host=False, bind_host="127.0.0.1", transfer_timeout_s=5.0) as late:
            # Still open for the prefiller's word: a late write lands (in fenced pages only).
            page = late.register(np.ones(cache.page_bytes, dtype=np.uint8))
            late.write(page, 0, res.descriptor, offset, cache.page_bytes).wait(10)
        revoked_at: float | None = None
        end = time.monotonic() + DEADLINE_S
        while decode.ledger.get("c") is not None and time.monotonic() < end:
            if revoked_at is None and entry.deadline_setting is DeadlineSetting.FENCE:
                revoked_at = time.monotonic()
                assert entry.state is Res.FENCED and decode.allocator.free_pages < decode.allocator.total_pages
                with TransferEngine("net", same_host=False, bind_host="127.0.0.1", transfer_timeout_s=5.0) as late:
                    page = late.register(np.ones(cache.page_bytes, dtype=np.uint8))
                    with pytest.raises(TransferError):
                        late.write(page, 0, res.descriptor, offset, cache.page_bytes).wait(10)
            time.sleep(0.01)
        freed_at = time.monotonic()
        assert revoked_at is not None, "the registration was never revoked at its bound"
        assert decode.ledger.get("c") is None, "the pages were never freed"
        # Bounds, not speeds: not revoked before the bound, not freed before the fence.
        assert revoked_at - fenced_at >= bound_s
        assert freed_at - fenced_at >= fence_s
        assert decode.allocator.free_pages == decode.allocator.total_pages
    finally:
        decode.close()


def test_the_confirm_bound_leaves_the_revoke_grace_inside_the_fence() -> None:
    # The default (10 s) is cut where the fence is short; a value set above it is refused.
    short = DecodeSettings(fence_timeout_s=3.0)
    assert short.cancel_confirm_bound_s == 3.0 - short.revoke_grace_s
    assert DecodeSettings().cancel_confirm_bound_s == 10.0
    with pytest.raises(ValueError, match="cancel_confirm_timeout_s"):
        DecodeSettings(fence_timeout_s=3.0, cancel_confirm_timeout_s=2.5)


# -- the prefiller's process --------------------------------------------------------------------

def _writer_main() -> None:
    """Writes what stdin's spec says into two reservations, as a prefiller: whole windows
    of both interleaved, `rounds_before` of them; says "posted"; on "go", `rounds_after`
    more, then each page once with the reservation's immediate and its mailbox record;
    says "done" with each reservation's failed writes."""
    spec = json.loads(sys.stdin.readline())
    num_pages, page_bytes, layers = spec["num_pages"], spec["page_bytes"], spec["num_layers"]
    src = _source(num_pages * page_bytes * layers)
    targets = spec["targets"]
    with TransferEngine("net", same_host=False, bind_host="127.0.0.1", transfer_timeout_s=20.0) as engine:
        src_mr = engine.register(src)
        records = np.zeros(4096 * len(targets), dtype=np.uint8)
        posted: dict[str, list[Any]] = {r: [] for r in targets}

        def windows(r: str) -> None:
            for layer in range(layers):
                for first, count in page_runs(targets[r]["pages"]):
                    offset = (layer * num_pages + first) * page_bytes
                    posted[r].append(engine.write(src_mr, offset, bytes.fromhex(targets[r]["descriptor"]), offset,
                                                  count * page_bytes))

        def rounds(n: int) -> None:
            for _ in range(n):
                for r in targets:
                    windows(r)

        rounds(spec["rounds_before"])
        writes = sum(len(p) for p in posted.values())
        mib = sum(t.bytes for p in posted.values() for t in p) / 2**20
        print(json.dumps({"said": "posted", "writes": writes, "mib": mib}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        rounds(spec["rounds_after"])
        records_mr = engine.register(records)
        for i, (r, target) in enumerate(targets.items()):
            descriptor = bytes.fromhex(target["descriptor"])
            for layer in range(layers):
                for page in target["pages"]:
                    offset = (layer * num_pages + page) * page_bytes
                    posted[r].append(engine.write(src_mr, offset, descriptor, offset, page_bytes, imm=target["imm"]))
            # Declares what it posted with the immediate: each page of each layer, and this record.
            record = encode_mailbox(target["nonce"], FIRST_TOKEN, spec["prompt_tokens"],
                                    units=layers * len(target["pages"]) + 1)
            records[i * 4096:i * 4096 + len(record)] = np.frombuffer(record, dtype=np.uint8)
            posted[r].append(engine.write(records_mr, i * 4096, bytes.fromhex(target["meta_descriptor"]),
                                          target["meta_offset"], len(record), imm=target["imm"]))
        outcome: dict[str, Any] = {}
        for r, transfers in posted.items():
            errors = []
            for transfer in transfers:
                try:
                    transfer.wait(30)
                except Exception as exc:  # each failure is counted; the first is named
                    errors.append(str(exc))
            outcome[r] = {"failed": len(errors), "first_error": errors[0] if errors else ""}
        print(json.dumps({"said": "done", **outcome}), flush=True)


if __name__ == "__main__":
    _writer_main()
