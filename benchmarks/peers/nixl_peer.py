"""NVIDIA NIXL peer for compare_peers.py (runs in .bench-venvs/nixl, UCX backend).

API used (package `nixl`, module `nixl._api`):
- `nixl_agent(name, nixl_agent_config(backends=["UCX"]))`, `register_memory(
  [(addr, len, 0, "")], "DRAM")`, `get_agent_metadata()` / `add_remote_agent(md)`
  exchanged through the harness's control channel.
- Descriptor lists are prepared once (`prep_xfer_dlist`) and transfer requests built from
  them once (`make_prepped_xfer`), outside the timings; each repeat re-posts the same
  requests with `transfer(handle)` and polls `check_xfer_state`. That is NIXL's intended
  fast path for a fixed block table.
- Receiver-side completion: every KV request (one per layer and K|V, like one kvxfer
  paged write) carries a notification; the target counts them with `get_new_notifs()`.
The UCX transports come from the environment: compare_peers.py sets UCX_TLS=tcp for the
TCP-class run and leaves UCX's default (shared memory on one host) for the other.
Traps: NIXL logs on stdout (results go to the --result file) and may crash at interpreter
exit (the harness leaves with os._exit after writing the result).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import peer_harness as ph  # noqa: E402


class NixlPeer(ph.PeerSystem):
    name = "nixl"
    kv_completion = "receiver (one notification per layer x K|V request)"

    def __init__(self, args: Any, wl: ph.Workload) -> None:
        super().__init__(args, wl)
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(f"{args.role}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        self.depth = int(args.nixl_window)
        self.per_req = int(args.nixl_descs_per_req)
        self.notes.update(backend="UCX", ucx_tls=os.environ.get("UCX_TLS", "(UCX default)"),
                          requests_in_flight=self.depth, descriptors_per_request=self.per_req)

    def _register(self, buf: np.ndarray) -> None:
        self.agent.register_memory([(int(buf.ctypes.data), int(buf.nbytes), 0, "")], "DRAM")

    # -- target ------------------------------------------------------------------------
    def target_setup(self, dst: np.ndarray) -> dict[str, Any]:
        self._register(dst)
        self.kv_seen = 0
        return {"md": self.agent.get_agent_metadata().hex(), "addr": int(dst.ctypes.data)}

    def target_hello(self, init_info: dict[str, Any]) -> None:
        self.peer = self.agent.add_remote_agent(bytes.fromhex(init_info["md"]))

    def target_arm(self, rep: int) -> None:
        self.agent.get_new_notifs()  # drop stale ones
        self.kv_seen = 0

    def target_wait_kv(self, rep: int, deadline: float) -> bool:
        want = f"kv{rep}".encode()
        need = self.wl.layers * 2
        while time.monotonic() < deadline:
            for msgs in self.agent.get_new_notifs().values():
                self.kv_seen += sum(1 for m in msgs if m == want)
            if self.kv_seen >= need:
                return True
            time.sleep(50e-6)
        return False

    # -- initiator ---------------------------------------------------------------------
    def initiator_setup(self, src: np.ndarray, target_info: dict[str, Any]) -> dict[str, Any]:
        self._register(src)
        self.src = src
        self.remote = self.agent.add_remote_agent(bytes.fromhex(target_info["md"]))
        self.base_s, self.base_d = int(src.ctypes.data), int(target_info["addr"])
        return {"md": self.agent.get_agent_metadata().hex()}

    def _dlists(self, src_offs: np.ndarray, dst_offs: np.ndarray, length: int):
        n = len(src_offs)
        loc = np.empty((n, 3), dtype=np.uint64)
        rem = np.empty((n, 3), dtype=np.uint64)
        loc[:, 0] = src_offs.astype(np.uint64) + np.uint64(self.base_s)
        rem[:, 0] = dst_offs.astype(np.uint64) + np.uint64(self.base_d)
        loc[:, 1] = rem[:, 1] = length
        loc[:, 2] = rem[:, 2] = 0
        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
        rh = self.agent.prep_xfer_dlist(self.remote, rem, "DRAM")
        return lh, rh

    def initiator_connect(self) -> None:
        wl = self.wl
        self.agent.make_connection(self.remote)
        if wl.kind == "bulk":
            offs = wl.bulk_offsets()
            lh, rh = self._dlists(offs, offs, wl.write_size)
            idx = np.arange(len(offs), dtype=np.int32)
            self.reqs = [
                self.agent.make_prepped_xfer("WRITE", lh, idx[a : a + self.per_req], rh, idx[a : a + self.per_req])
                for a in range(0, len(offs), self.per_req)
            ]
        elif wl.kind == "kv":
            so, do = wl.kv_segments()
            lh, rh = self._dlists(so, do, wl.page_size)
            n = wl.pages
            idx = np.arange(len(so), dtype=np.int32)
            # One request per (layer, K|V): the unit a layer-by-layer push posts.
            self.reqs = [
                self.agent.make_prepped_xfer("WRITE", lh, idx[a : a + n], rh, idx[a : a + n])
                for a in range(0, len(so), n)
            ]
        else:
            off = np.zeros(1, dtype=np.int64)
            lh, rh = self._dlists(off, off, wl.write_size)
            self.reqs = [self.agent.make_prepped_xfer("WRITE", lh, [0], rh, [0])]
        # Warm-up post of one request: first-use costs (UCX endpoint wire-up) stay out.
        self._post(self.reqs[0], b"")
        self._wait(self.reqs[0])

    def _post(self, h: Any, notif: bytes) -> None:
        if self.agent.transfer(h, notif) == "ERR":
            raise RuntimeError("NIXL transfer() returned ERR")

    def _wait(self, h: Any, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        while True:
            st = self.agent.check_xfer_state(h)
            if st == "DONE":
                return
            if st == "ERR":
                raise RuntimeError("NIXL transfer failed (check_xfer_state ERR)")
            if time.monotonic() > end:
                raise TimeoutError("NIXL transfer did not complete")

    def run_bulk(self, rep: int) -> None:
        inflight: list[Any] = []
        for h in self.reqs:
            if len(inflight) >= self.depth:
                self._wait(inflight.pop(0))
            self._post(h, b"")
            inflight.append(h)
        for h in inflight:
            self._wait(h)

    def run_kv(self, rep: int) -> None:
        notif = f"kv{rep}".encode()
        for h in self.reqs:
            self._post(h, notif)
        for h in self.reqs:
            self._wait(h)

    def lat_once(self) -> None:
        h = self.reqs[0]
        if self.agent.transfer(h) == "DONE":
            return
        self._wait(h)


def _extra(p: Any) -> None:
    p.add_argument("--nixl-window", type=int, default=64, help="NIXL requests in flight (bulk)")
    p.add_argument("--nixl-descs-per-req", type=int, default=1,
                   help="write descriptors per NIXL request (bulk); 1 = one request per write")


if __name__ == "__main__":
    ph.main(NixlPeer, _extra)
