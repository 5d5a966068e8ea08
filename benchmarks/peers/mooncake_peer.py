"""Mooncake Transfer Engine peer for compare_peers.py (runs in .bench-venvs/mooncake).

API used (package `mooncake-transfer-engine-non-cuda`, module `mooncake.engine`):
- `TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`: TCP transport,
  peers found by a direct handshake with the target's RPC port (no metadata server).
  The target's name for the initiator is "127.0.0.1:<get_rpc_port()>".
- `register_memory(addr, length)`; remote addresses are the target's virtual addresses.
- `batch_transfer_async_write(host, srcs, dsts, lens)` -> batch id (0 on failure) and
  `get_batch_transfer_status([ids])`, which blocks until those batches end (0 = done).
- Receiver-side completion: `batch_transfer_sync(..., TransferOpcode.Write,
  TransferNotify(name, msg))` sends a notification to the target once its batch
  completed; the target polls `get_notifies()`.
Traps: the TCP transport rejects a peer's transfers beyond
MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (default 1024 requests queued per peer; values above
16384 are refused), and after such a rejection the engine keeps failing every later
transfer, so chunk x window stays <= 1024 here. MC_TCP_BIND_ADDRESS must be 127.0.0.1 for
the listener to be reachable on loopback in this sandbox.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import peer_harness as ph  # noqa: E402

# Mooncake's default per-peer queue limit (see the module docstring).
_MC_QUEUE_LIMIT = 1024


class MooncakePeer(ph.PeerSystem):
    name = "mooncake"
    # The notification rides on the last batch, sent once every earlier batch completed
    # at the initiator: the target learns of completion one notify RPC after the data.
    kv_completion = "receiver (TransferNotify after last batch)"

    def __init__(self, args: Any, wl: ph.Workload) -> None:
        super().__init__(args, wl)
        from mooncake.engine import TransferEngine

        self.eng = TransferEngine()
        rc = self.eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"mooncake initialize failed: {rc}")
        self.chunk = int(args.mc_chunk)
        self.window = int(args.mc_window)
        if self.chunk * self.window > _MC_QUEUE_LIMIT:
            raise ValueError(
                f"mc-chunk x mc-window = {self.chunk * self.window} exceeds Mooncake's "
                f"per-peer queue of {_MC_QUEUE_LIMIT} (the engine breaks on overflow)"
            )
        self.notes.update(protocol="tcp", metadata="P2PHANDSHAKE", batch_entries=self.chunk,
                          batches_in_flight=self.window)

    # -- target ------------------------------------------------------------------------
    def target_setup(self, dst: np.ndarray) -> dict[str, Any]:
        self.dst = dst
        rc = self.eng.register_memory(int(dst.ctypes.data), int(dst.nbytes))
        if rc != 0:
            raise RuntimeError(f"register_memory failed: {rc}")
        return {"host": f"127.0.0.1:{self.eng.get_rpc_port()}", "addr": int(dst.ctypes.data)}

    def target_arm(self, rep: int) -> None:
        self.eng.get_notifies()  # drop stale notifications

    def target_wait_kv(self, rep: int, deadline: float) -> bool:
        want = f"kv{rep}"
        while time.monotonic() < deadline:
            for n in self.eng.get_notifies():
                if n.name == want:
                    return True
            time.sleep(50e-6)  # polling cost: one Python loop per 50 us on a 2-core box
        return False

    # -- initiator ---------------------------------------------------------------------
    def initiator_setup(self, src: np.ndarray, target_info: dict[str, Any]) -> dict[str, Any]:
        self.src = src
        rc = self.eng.register_memory(int(src.ctypes.data), int(src.nbytes))
        if rc != 0:
            raise RuntimeError(f"register_memory failed: {rc}")
        self.host = target_info["host"]
        base_s, base_d = int(src.ctypes.data), int(target_info["addr"])
        wl = self.wl
        # Address lists are built before timing, as a KV connector computes them from its
        # block table before it starts the push.
        if wl.kind == "bulk":
            offs = wl.bulk_offsets()
            self.srcs = (offs + base_s).tolist()
            self.dsts = (offs + base_d).tolist()
            self.length = wl.write_size
        elif wl.kind == "kv":
            so, do = wl.kv_segments()
            self.srcs = (so + base_s).tolist()
            self.dsts = (do + base_d).tolist()
            self.length = wl.page_size
        else:
            self.lat_args = (self.host, base_s, base_d, wl.write_size)
        return {}

    def initiator_connect(self) -> None:
        # First transfer opens the segment (handshake); keep it out of the timings.
        rc = self.eng.transfer_sync_write(self.host, int(self.src.ctypes.data),
                                          int(self.dsts[0]) if hasattr(self, "dsts") else self.lat_args[2], 8)
        if rc != 0:
            raise RuntimeError(f"warm-up transfer_sync_write failed: {rc}")

    def _submit_window(self, srcs: list[int], dsts: list[int]) -> None:
        pending: list[int] = []
        for a in range(0, len(srcs), self.chunk):
            s, d = srcs[a : a + self.chunk], dsts[a : a + self.chunk]
            bid = self.eng.batch_transfer_async_write(self.host, s, d, [self.length] * len(s))
            if not bid:
                raise RuntimeError("batch_transfer_async_write failed")
            pending.append(bid)
            if len(pending) >= self.window:
                if self.eng.get_batch_transfer_status([pending.pop(0)]) != 0:
                    raise RuntimeError("a Mooncake batch failed")
        if pending and self.eng.get_batch_transfer_status(pending) != 0:
            raise RuntimeError("a Mooncake batch failed")

    def run_bulk(self, rep: int) -> None:
        self._submit_window(self.srcs, self.dsts)

    def run_kv(self, rep: int) -> None:
        from mooncake.engine import TransferNotify, TransferOpcode

        last = max(0, len(self.srcs) - self.chunk)
        self._submit_window(self.srcs[:last], self.dsts[:last])
        s, d = self.srcs[last:], self.dsts[last:]
        rc = self.eng.batch_transfer_sync(self.host, s, d, [self.length] * len(s),
                                          TransferOpcode.Write, TransferNotify(f"kv{rep}", "done"))
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync with notify failed: {rc}")

    def lat_once(self) -> None:
        if self.eng.transfer_sync_write(*self.lat_args) != 0:
            raise RuntimeError("transfer_sync_write failed")


def _extra(p: Any) -> None:
    p.add_argument("--mc-chunk", type=int, default=256, help="write requests per Mooncake batch")
    p.add_argument("--mc-window", type=int, default=4, help="Mooncake batches in flight")


if __name__ == "__main__":
    ph.main(MooncakePeer, _extra)
