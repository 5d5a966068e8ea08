"""kvxfer peer for compare_peers.py (runs in the project's .venv).

API used (docs/architecture.md): `TransferEngine(provider=..., rails=...)`,
`eng.register(numpy_array).descriptor` (bytes, hex through the rendezvous file),
`eng.write(mr, src_off, remote_desc, dst_off, length, imm=7)` -> Transfer with
`.wait(timeout)`, `eng.write_paged(mr, src_pages, remote_desc, dst_pages, page_size,
src_stride, dst_stride, src_offset, dst_offset, imm=9)`, and at the receiver
`eng.wait_imm(imm, count, timeout)` (one unit per single write, one per page).
With `--same-host on` the target's buffer is a `kvxfer.SharedBuffer`, as the KV cache is.
With `--progress caller` the initiator's engine has no progress thread: the thread that
submits and waits drives it (the target keeps its thread).
Bulk writes keep `--depth` transfers in flight: by default with `write_many` into a
`CompletionCounter` (`--submit many`), or one handle per write, waiting for the oldest
(`--submit handles`). The KV
push is one paged write per (layer, K|V), all submitted back to back, and its completion
is the receiver's ImmCounter reaching layers x 2 x pages.
"""

from __future__ import annotations

import collections
import time
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import peer_harness as ph  # noqa: E402


class KvxferPeer(ph.PeerSystem):
    name = "kvxfer"
    kv_completion = "receiver (ImmCounter)"

    def __init__(self, args: Any, wl: ph.Workload) -> None:
        super().__init__(args, wl)
        from kvxfer import TransferEngine

        kwargs: dict[str, Any] = {"provider": args.provider, "rails": int(args.rails),
                                  "same_host": args.same_host == "on"}
        if args.progress == "caller" and args.role == "initiator":
            # The target keeps its progress thread: a passive target makes no calls, and
            # with caller-driven progress its peers' writes would wait for one.
            kwargs["progress"] = "caller"
        try:
            self.eng = TransferEngine(bind_host="127.0.0.1", **kwargs)
        except TypeError:  # an engine without bind_host: fall back to the environment
            os.environ.setdefault("KVXFER_BIND_HOST", "127.0.0.1")
            self.eng = TransferEngine(**kwargs)
        self.wait_s = float(args.timeout_s)
        self.notes.update(provider=str(getattr(self.eng, "provider", args.provider)),
                          same_host=args.same_host,
                          rails=int(getattr(self.eng, "rails", args.rails)), depth=int(args.depth),
                          progress=str(getattr(self.eng, "progress", "thread")))

    # -- target ------------------------------------------------------------------------
    def alloc_target_buffer(self, nbytes: int) -> np.ndarray | None:
        # With the same-host path, the destination lives where kvxfer keeps its KV cache: a
        # SharedBuffer (memfd) that a writer on this machine maps and fills with memcpy.
        if self.args.same_host != "on":
            return None
        from kvxfer import SharedBuffer

        return SharedBuffer(nbytes).array

    def target_setup(self, dst: np.ndarray) -> dict[str, Any]:
        self.mr = self.eng.register(dst)
        return {"desc": bytes(self.mr.descriptor).hex()}

    def _reset(self, imm: int) -> None:
        if hasattr(self.eng, "reset_imm"):
            self.eng.reset_imm(imm)
        else:
            n = self.eng.imm_count(imm)
            if n:
                self.eng.consume_imm(imm, n)

    def target_arm(self, rep: int) -> None:
        self._reset(ph.KV_IMM)
        self._reset(ph.BULK_IMM)

    def target_wait_kv(self, rep: int, deadline: float) -> bool:
        try:
            r = self.eng.wait_imm(ph.KV_IMM, self.wl.n_writes, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # TransferTimeout: report it as a missed completion
            self.notes["wait_imm_error"] = f"{type(e).__name__}: {e}"
            return False
        return r is not False

    def target_wait_bulk(self, rep: int, deadline: float) -> bool | None:
        # Bulk writes carry imm=7, so the receiver knows when all of them landed too.
        try:
            self.eng.wait_imm(ph.BULK_IMM, self.wl.n_writes, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001
            self.notes["wait_imm_error"] = f"{type(e).__name__}: {e}"
            return False
        return True

    def target_check(self, rep: int) -> str | None:
        # Every write must have been counted exactly once (one unit per single write, one
        # per page), however the engine sharded or coalesced it.
        imm = ph.KV_IMM if self.wl.kind == "kv" else ph.BULK_IMM
        if self.wl.kind in ("kv", "bulk"):
            n = self.eng.imm_count(imm)
            if n != self.wl.n_writes:
                return f"imm {imm}: counted {n}, expected {self.wl.n_writes}"
        return None

    # -- initiator ---------------------------------------------------------------------
    def initiator_setup(self, src: np.ndarray, target_info: dict[str, Any]) -> dict[str, Any]:
        self.mr = self.eng.register(src)
        self.rdesc = bytes.fromhex(target_info["desc"])
        return {}

    def initiator_connect(self) -> None:
        # One small write (no immediate) so the connection exists before the timings.
        self.eng.write(self.mr, 0, self.rdesc, 0, 8).wait(timeout=self.wait_s)

    def run_bulk(self, rep: int) -> None:
        if self.args.submit == "many":
            self._run_bulk_many()
            return
        ws, depth, eng, mr, rd = self.wl.write_size, int(self.args.depth), self.eng, self.mr, self.rdesc
        inflight: collections.deque = collections.deque()
        for off in range(0, self.wl.total, ws):
            if len(inflight) >= depth:
                inflight.popleft().wait(timeout=self.wait_s)
            inflight.append(eng.write(mr, off, rd, off, ws, imm=ph.BULK_IMM))
        while inflight:
            inflight.popleft().wait(timeout=self.wait_s)

    def _run_bulk_many(self) -> None:
        # What kvxfer's API offers for many writes (as Mooncake's peer uses its batch API):
        # write_many calls of a quarter window into one CompletionCounter, and one counter
        # wait per call for the window to have room; no handle per write.
        ws, depth = self.wl.write_size, int(self.args.depth)
        offsets = np.arange(0, self.wl.total, ws, dtype=np.int64)
        batch = max(1, depth // 4)
        counter = self.eng.completion_counter()
        for start in range(0, len(offsets), batch):
            end = min(start + batch, len(offsets))
            if end > depth:
                counter.wait(end - depth, timeout=self.wait_s)
            part = offsets[start:end]
            self.eng.write_many(self.mr, part, self.rdesc, part, ws, imm=ph.BULK_IMM, counter=counter)
        counter.wait(timeout=self.wait_s)

    def run_kv(self, rep: int) -> None:
        wl, stride = self.wl, self.wl.kv_stride()
        ts = [
            self.eng.write_paged(
                self.mr, wl.src_pages, self.rdesc, wl.dst_pages, wl.page_size,
                src_stride=stride, dst_stride=stride,
                src_offset=wl.kv_src_offset(layer, kv), dst_offset=wl.kv_dst_offset(layer, kv),
                imm=ph.KV_IMM,
            )
            for layer in range(wl.layers)
            for kv in range(2)
        ]
        for t in ts:
            t.wait(timeout=self.wait_s)

    def lat_once(self) -> None:
        self.eng.write(self.mr, 0, self.rdesc, 0, self.wl.write_size).wait(timeout=self.wait_s)


def _extra(p: Any) -> None:
    p.add_argument("--provider", default="tcp", help="libfabric provider: tcp, net, shm, auto")
    p.add_argument("--rails", type=int, default=1)
    p.add_argument("--same-host", choices=("on", "off"), default="off",
                   help="on: kvxfer's process-to-process path for peers on this machine")
    p.add_argument("--progress", choices=("thread", "caller"), default="thread",
                   help="the initiator's engine: a progress thread, or progress driven by the "
                        "calling thread (TransferEngine(progress='caller')); targets use a thread")
    p.add_argument("--submit", choices=("many", "handles"), default="many",
                   help="bulk writes: many = write_many calls of a quarter --depth into one "
                        "CompletionCounter (kvxfer's API for many writes); handles = one write() "
                        "and handle per write, waiting for the oldest at --depth")


if __name__ == "__main__":
    ph.main(KvxferPeer, _extra)
