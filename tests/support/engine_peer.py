"""A kvxfer engine in its own process, driven by JSON lines on stdin/stdout.

tests/test_engine.py starts one of these as the far side of every two-process transfer:
it is a target (it registers memory and hands out descriptors) and an initiator (it
writes into memory the test process registered), so both directions cross a real
process boundary. Bytes travel as hex; big buffers are compared through `dump`, which
writes a region to a file the test reads back.

Start-up line, then one reply per request:
    {"ok": true, "address": hex, "descriptor": hex, "provider": str, "rails": int, "pid": int}
    request  {"op": name, ...arguments}
    reply    {"ok": true, ...} or {"ok": false, "error": ExceptionClassName, "message": str}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from kvxfer import SharedBuffer
from kvxfer.transfer.engine import MemoryWindows, RegisteredMemory, Transfer, TransferEngine
from kvxfer.errors import KvxferError


#: The test modes that take the same-host path: regions in plain memory (process_vm_writev)
#: and regions in SharedBuffers (mapped by the writer, memcpy). Every other mode is a
#: libfabric provider name, tested with the same-host path off.
SAME_HOST = "same-host"
SAME_HOST_MAPPED = "same-host-mapped"
SAME_HOST_MODES = (SAME_HOST, SAME_HOST_MAPPED)


def provider_of(mode: str) -> str:
    """The libfabric provider a test mode runs on: same-host sends its immediates over net
    (or tcp where libfabric has no net provider)."""
    if mode not in SAME_HOST_MODES:
        return mode
    from kvxfer.transfer.engine import available_providers

    return "net" if "net" in available_providers() else "tcp"


def engine_options(mode: str) -> dict[str, Any]:
    """TransferEngine arguments of a test mode."""
    return {"provider": provider_of(mode), "same_host": mode in SAME_HOST_MODES}


def region_buffer(mode: str, size: int) -> np.ndarray:
    """A zeroed buffer to register: in a SharedBuffer in the mapped mode (registration keeps
    the SharedBuffer alive), plain numpy memory otherwise."""
    if mode == SAME_HOST_MAPPED:
        return SharedBuffer(size).array
    return np.zeros(size, dtype=np.uint8)


def seeded_bytes(seed: int, length: int) -> np.ndarray:
    """`length` pseudo-random bytes from numpy's default_rng(seed): the same on both sides.

    Drawn as full-range 64-bit words, numpy's fastest path: 64 MiB costs a fraction of a
    second even on the shared 2-core test machine.
    """
    words = np.random.default_rng(seed).integers(
        0, 2**64 - 1, (length + 7) // 8, dtype=np.uint64, endpoint=True
    )
    return words.view(np.uint8)[:length]


class EnginePeer:
    """Serves test requests against one engine and the regions it registered."""

    def __init__(self, engine: TransferEngine, size: int, mode: str) -> None:
        self.engine = engine
        self.mode = mode
        self.buffers: list[np.ndarray] = []
        self.regions: list[RegisteredMemory] = []
        self.stream: list[Transfer] = []
        self.windows: list[MemoryWindows] = []
        self.add_region(size)

    def add_region(self, size: int) -> dict[str, Any]:
        buf = region_buffer(self.mode, size)
        self.buffers.append(buf)
        self.regions.append(self.engine.register(buf))
        return {
            "region": len(self.regions) - 1,
            "descriptor": self.regions[-1].descriptor.hex(),
            "address": self.regions[-1].address,
        }

    # -- requests -------------------------------------------------------------------------
    def op_register(self, size: int) -> dict[str, Any]:
        return self.add_region(size)

    def op_deregister(self, region: int) -> dict[str, Any]:
        """Withdraws a region from the engine; its buffer stays allocated for reads."""
        self.engine.deregister(self.regions[region])
        return {}

    def op_register_windows(self, ranges: list[list[int]], region: int = 0) -> dict[str, Any]:
        """Registers parts of a region again with fresh keys; the reply's `windows` names them."""
        windows = self.engine.register_windows(self.regions[region], [(o, n) for o, n in ranges])
        self.windows.append(windows)
        return {"windows": len(self.windows) - 1, "descriptor": windows.descriptor.hex()}

    def op_close_windows(self, windows: int) -> dict[str, Any]:
        self.windows[windows].close()
        return {}

    def op_fill(
        self, region: int = 0, seed: int | None = None, length: int | None = None
    ) -> dict[str, Any]:
        """Sets the first `length` bytes of a region (all by default) to seeded random
        bytes, or to zeros when seed is None."""
        buf = self.buffers[region][:length]
        if seed is None:
            buf[:] = 0
        else:
            buf[:] = seeded_bytes(seed, buf.size)
        return {}

    def op_dump(
        self, path: str, offset: int = 0, length: int | None = None, region: int = 0
    ) -> dict[str, Any]:
        buf = self.buffers[region]
        buf[offset : buf.size if length is None else offset + length].tofile(path)
        return {}

    def op_read(self, offset: int, length: int, region: int = 0) -> dict[str, Any]:
        return {"data": self.buffers[region][offset : offset + length].tobytes().hex()}

    def op_write(
        self,
        descriptor: str,
        src_offset: int,
        dst_offset: int,
        length: int,
        imm: int | None = None,
        region: int = 0,
        timeout: float = 20.0,
    ) -> dict[str, Any]:
        t = self.engine.write(
            self.regions[region], src_offset, bytes.fromhex(descriptor), dst_offset, length, imm
        )
        t.wait(timeout)
        return {}

    def op_write_paged(
        self,
        descriptor: str,
        src_pages: list[int],
        dst_pages: list[int],
        page_size: int,
        imm: int | None = None,
        region: int = 0,
        timeout: float = 20.0,
    ) -> dict[str, Any]:
        remote = bytes.fromhex(descriptor)
        t = self.engine.write_paged(
            self.regions[region], src_pages, remote, dst_pages, page_size, imm=imm
        )
        t.wait(timeout)
        return {}

    def op_recv(self, timeout: float) -> dict[str, Any]:
        msg = self.engine.recv(timeout)
        return {"payload": None if msg is None else msg.hex()}

    def op_echo(self, timeout: float) -> dict[str, Any]:
        """Receives one control message '<address hex>|<payload hex>' and sends the payload
        back to that address reversed, so the test sees a round trip it can check."""
        msg = self.engine.recv(timeout)
        if msg is None:
            return {"echoed": False}
        address, payload = msg.split(b"|", 1)
        reply = bytes.fromhex(payload.decode())[::-1]
        self.engine.send(bytes.fromhex(address.decode()), reply).wait(timeout)
        return {"echoed": True}

    def op_write_imms(self, target: str, imms: list[int], timeout: float = 20.0) -> dict[str, Any]:
        """One immediate-only write per value in `imms` to an engine address; waits for all."""
        transfers = [self.engine.write_imm(bytes.fromhex(target), imm) for imm in imms]
        for t in transfers:
            t.wait(timeout)
        return {}

    def op_send_many(
        self, target: str, count: int, size: int, timeout: float = 20.0
    ) -> dict[str, Any]:
        """`count` control messages of `size` bytes to an engine address, message i filled
        with byte i % 256; waits until every send completed."""
        address = bytes.fromhex(target)
        transfers = [self.engine.send(address, bytes([i % 256]) * size) for i in range(count)]
        for t in transfers:
            t.wait(timeout)
        return {}

    def op_engine_stats(self) -> dict[str, Any]:
        return {"stats": self.engine.engine_stats()}

    def op_imm_count(self, imm: int) -> dict[str, Any]:
        return {"count": self.engine.imm_count(imm)}

    def op_wait_imm(self, imm: int, count: int, timeout: float) -> dict[str, Any]:
        self.engine.wait_imm(imm, count, timeout)
        return {"count": self.engine.imm_count(imm)}

    def op_stream(
        self, descriptor: str, count: int, length: int, wait_first: int, timeout: float = 20.0
    ) -> dict[str, Any]:
        """Submits `count` writes of region 0 without waiting for them, then waits for the
        first `wait_first` only, so the caller knows the stream is under way."""
        remote = bytes.fromhex(descriptor)
        self.stream = [
            self.engine.write(self.regions[0], 0, remote, 0, length, request_id=i)
            for i in range(count)
        ]
        for t in self.stream[:wait_first]:
            t.wait(timeout)
        return {"submitted": count, "done": sum(t.done() for t in self.stream)}

    def op_settle(self, timeout: float) -> dict[str, Any]:
        """Waits until every streamed write finished or `timeout` passed; counts outcomes.

        "pending" counts writes the engine had not finished by then: its own deadline
        (transfer_timeout_s) should have failed them first.
        """
        start = time.monotonic()
        deadline = start + timeout
        outcomes: dict[str, int] = {}
        messages: dict[str, str] = {}
        for t in self.stream:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
                kind = "ok"
            except KvxferError as e:
                # A wait that gave up leaves the transfer pending; the engine's failures end it.
                kind = type(e).__name__ if t.done() else "pending"
                messages.setdefault(kind, str(e))
            outcomes[kind] = outcomes.get(kind, 0) + 1
        return {"outcomes": outcomes, "messages": messages, "elapsed_s": time.monotonic() - start}

    def op_exit(self) -> dict[str, Any]:
        return {}

    # -- device staging (kvxfer.transfer.device_staging) ---------------------------------
    def op_staging_receiver(self, device: str, page_bytes: int, cache_pages: int,
                            landing_pages: int) -> dict[str, Any]:
        """Makes a zeroed cache of `cache_pages` pages on `device` and a DevicePageReceiver
        for it with its own landing pages; the reply's descriptor writes those."""
        import torch

        from kvxfer.transfer.device_staging import DevicePageReceiver

        self.device_cache = torch.zeros(cache_pages * page_bytes, dtype=torch.uint8, device=device)
        self.receiver = DevicePageReceiver(self.engine, self.device_cache, page_bytes,
                                           landing_pages=landing_pages)
        return {"descriptor": self.receiver.descriptor.hex()}

    def op_staging_land(self, imm: int, count: int, landing_pages: list[int], cache_pages: list[int],
                        timeout_s: float) -> dict[str, Any]:
        """Waits until `imm` counted `count` arrivals, then lands the pages in the cache."""
        self.engine.wait_imm(imm, count, timeout_s)
        self.receiver.land(landing_pages, cache_pages)
        return {}

    def op_staging_digests(self) -> dict[str, Any]:
        """blake2b of every page of the device cache, read back to the host."""
        rows = self.device_cache.view(-1, self.receiver.page_bytes).cpu().numpy()
        return {"digests": [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in rows]}

    # -- loop -----------------------------------------------------------------------------
    def serve(self, requests: Any, reply: Callable[[dict[str, Any]], None]) -> None:
        for line in requests:
            if not line.strip():
                continue
            request = json.loads(line)
            name = request.pop("op")
            try:
                result = {"ok": True, **getattr(self, "op_" + name)(**request)}
            except Exception as e:  # the test decides whether this error was expected
                result = {"ok": False, "error": type(e).__name__, "message": str(e)}
            reply(result)
            if name == "exit":
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", required=True, help=f"a libfabric provider, or one of {', '.join(SAME_HOST_MODES)}")
    parser.add_argument("--rails", type=int, default=1)
    parser.add_argument("--size", type=int, required=True, help="bytes of region 0")
    parser.add_argument("--transfer-timeout-s", type=float, default=30.0)
    args = parser.parse_args()

    # Replies go through the original stdout only; anything else written to fd 1 (print,
    # libfabric's own logging) goes to stderr, the test's log of this peer.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    engine = TransferEngine(
        **engine_options(args.provider),
        rails=args.rails,
        bind_host="127.0.0.1",
        transfer_timeout_s=args.transfer_timeout_s,
    )
    try:
        peer = EnginePeer(engine, args.size, args.provider)
        reply(
            {
                "ok": True,
                "address": engine.address.hex(),
                "descriptor": peer.regions[0].descriptor.hex(),
                "provider": engine.provider,
                "rails": engine.rails,
                "pid": os.getpid(),
            }
        )
        peer.serve(sys.stdin, reply)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
