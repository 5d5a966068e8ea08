"""How fast do pages of a device (CUDA) cache move between two processes through pinned host
staging (kvxfer.transfer.device_staging), next to the copies the path is made of and to the
same paged write between host caches, in one run?

Two processes over the fabric (same-host path off, as between pods). The sender gathers
random pages of its device cache into pinned staging slots and posts one paged write per
chunk; the receiver waits on its ImmCounter, then lands the pages in random pages of its own
device cache. Timed from the sender's first copy until the receiver's landing copy finished
(one clock: both processes are on this machine). Beside it, measured in the same run:

- D2H: one gather of the same pages on the device and its copy into pinned memory;
- H2D: the copy of those bytes from pinned memory into the device cache, page by page;
- host paged write: the same random pages, host cache to the receiver's registered host
  pages, counted by the receiver's ImmCounter (what the engine does without a device).

The `x slowest` column holds the staged path against the slowest of the three: the pipeline
overlaps them, so a good one stays close to it. It can pass the host paged write, which
plans and posts all its pages as one write before the first leaves (on an H200, 1.32x at
16 KiB pages). Bytes are
checked: the receiver's cache pages against the sender's, by blake2b per page, once per page
size. With `--device cpu` every step runs with host copies (a smoke run on machines without
a GPU). Prints a table, writes JSON and a PNG.

    python benchmarks/bench_device_staging.py [--device cuda] [--page-sizes 16K,64K,256K] [--total 1G]
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_limits import parse_size  # noqa: E402
from report import parser_from_doc, pyplot, save_figure  # noqa: E402

from kvxfer.transfer.device_staging import DevicePageReceiver, DevicePageSender, page_rows  # noqa: E402
from kvxfer.transfer.engine import TransferEngine  # noqa: E402

REPLY_TIMEOUT_S = 300.0  # one receiver step: start-up, or landing a whole pass
WAIT_S = 120.0  # one pass's writes and immediates


def make_engine(provider: str, rails: int) -> TransferEngine:
    return TransferEngine(provider=provider, rails=rails, same_host=False, bind_host="127.0.0.1",
                          transfer_timeout_s=WAIT_S)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def page_digests(cache: torch.Tensor, page_bytes: int, pages: np.ndarray) -> list[str]:
    rows = page_rows(cache, page_bytes)[torch.from_numpy(pages).to(cache.device)].cpu().numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=16).hexdigest() for r in rows]


# -- the receiver (a child process, JSON lines) ------------------------------------------


class Receiver:
    """Serves the sender: a device cache with landing pages, and a host region for the
    host-paged baseline, both on one engine."""

    def __init__(self, engine: TransferEngine, device: torch.device) -> None:
        self.engine = engine
        self.device = device
        self.cache: torch.Tensor | None = None
        self.receiver: DevicePageReceiver | None = None
        self.host: np.ndarray | None = None
        self.host_region: Any = None

    def op_setup(self, page_bytes: int, pages: int) -> dict[str, Any]:
        if self.receiver is not None:
            self.receiver.close()
        if self.host_region is not None:
            self.engine.deregister(self.host_region)
        self.cache = torch.zeros(pages * page_bytes, dtype=torch.uint8, device=self.device)
        self.receiver = DevicePageReceiver(self.engine, self.cache, page_bytes, landing_pages=pages)
        self.host = np.zeros(pages * page_bytes, dtype=np.uint8)
        self.host_region = self.engine.register(self.host)
        return {"staged": self.receiver.descriptor.hex(), "host": self.host_region.descriptor.hex()}

    def op_land(self, imm: int, count: int, landing: list[int], final: list[int]) -> dict[str, Any]:
        assert self.receiver is not None
        self.engine.wait_imm(imm, count, WAIT_S)
        counted = time.monotonic()
        self.receiver.land(landing, final)
        return {"counted_s": counted, "landed_s": time.monotonic()}

    def op_count(self, imm: int, count: int) -> dict[str, Any]:
        self.engine.wait_imm(imm, count, WAIT_S)
        return {"counted_s": time.monotonic()}

    def op_digests(self, page_bytes: int, pages: list[int]) -> dict[str, Any]:
        assert self.cache is not None
        return {"digests": page_digests(self.cache, page_bytes, np.asarray(pages, dtype=np.int64))}


def serve(provider: str, rails: int, device: str) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libfabric's own output must not mix with the replies
    engine = make_engine(provider, rails)
    receiver = Receiver(engine, torch.device(device))
    out.write(json.dumps({"ok": True, "address": engine.address.hex()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            out.write(json.dumps({"ok": True, **getattr(receiver, "op_" + op)(**request)}) + "\n")
        except Exception as e:  # the sender reports it and stops
            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
    engine.close()


class ReceiverProcess:
    """The child, with a deadline on every reply."""

    def __init__(self, provider: str, rails: int, device: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "receiver", "--provider", provider,
                                      "--rails", str(rails), "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"receiver gave no reply within {REPLY_TIMEOUT_S} s (rc={self.proc.poll()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"receiver: {reply['error']}")
        return reply

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.read()

    def close(self) -> None:
        try:
            self.send("exit")
            self.proc.wait(30)
        except Exception:
            self.proc.kill()


# -- the sender (this process) -------------------------------------------------------------


def copy_limits(cache: torch.Tensor, page_bytes: int, src: np.ndarray, final: np.ndarray,
                repeats: int) -> dict[str, float]:
    """GB/s of the gather + copy into pinned memory (D2H) and of the copy from pinned memory
    into random cache pages (H2D), the same pages as the staged pass."""
    rows = page_rows(cache, page_bytes)
    device = cache.device
    pinned = torch.empty(src.size * page_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pinned_rows = pinned.view(src.size, page_bytes)
    src_index = torch.from_numpy(src).to(device)
    final_index = torch.from_numpy(final).to(device)
    out: dict[str, list[float]] = {"d2h_gbps": [], "h2d_gbps": []}
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        pinned_rows.copy_(rows.index_select(0, src_index), non_blocking=True)
        sync(device)
        out["d2h_gbps"].append(pinned.numel() / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        rows.index_copy_(0, final_index, pinned_rows.to(device, non_blocking=True))
        sync(device)
        out["h2d_gbps"].append(pinned.numel() / (time.perf_counter() - t) / 1e9)
    return {k: statistics.median(v) for k, v in out.items()}


def one_page_size(engine: TransferEngine, receiver: ReceiverProcess, device: torch.device, page_bytes: int,
                  total: int, repeats: int, chunk_pages: int, staging_bytes: int) -> dict[str, Any]:
    pages = total // page_bytes
    rng = np.random.default_rng(page_bytes)
    descs = receiver.call("setup", page_bytes=page_bytes, pages=pages)
    staged_desc, host_desc = bytes.fromhex(descs["staged"]), bytes.fromhex(descs["host"])
    generator = torch.Generator(device=device).manual_seed(page_bytes)
    cache = torch.randint(0, 256, (pages * page_bytes,), dtype=torch.uint8, device=device, generator=generator)
    sender = DevicePageSender(engine, cache, page_bytes, staging_pages=max(staging_bytes // page_bytes, chunk_pages),
                              chunk_pages=chunk_pages)
    host = np.random.default_rng(1).integers(0, 256, pages * page_bytes, dtype=np.uint8)
    host_region = engine.register(host)
    staged, host_paged, tails = [], [], []
    imm = page_bytes  # distinct per page size; + k per pass below
    src = final = landing = np.arange(0)
    for k in range(repeats + 1):  # pass 0 warms both sides up (connections, first touches)
        src = rng.permutation(pages).astype(np.int64)
        landing = np.arange(pages, dtype=np.int64)
        final = rng.permutation(pages).astype(np.int64)
        imm += 2
        sync(device)
        receiver.send("land", imm=imm, count=pages, landing=landing.tolist(), final=final.tolist())
        t0 = time.monotonic()
        push = sender.push(src, staged_desc, landing, imm=imm)
        push.wait(WAIT_S)
        posted_done = time.monotonic()
        got = receiver.read()
        if k:
            staged.append(total / (got["landed_s"] - t0) / 1e9)
            tails.append((got["landed_s"] - max(got["counted_s"], posted_done)) * 1e6)
        receiver.send("count", imm=imm + 1, count=pages)
        t0 = time.monotonic()
        engine.write_paged(host_region, src, host_desc, final, page_bytes, imm=imm + 1).wait(WAIT_S)
        got = receiver.read()
        if k:
            host_paged.append(total / (got["counted_s"] - t0) / 1e9)
    expected = page_digests(cache, page_bytes, src)
    got_digests = receiver.call("digests", page_bytes=page_bytes, pages=final.tolist())["digests"]
    wrong = sum(a != b for a, b in zip(expected, got_digests))
    limits = copy_limits(cache, page_bytes, src, final, repeats)
    sender.close()
    engine.deregister(host_region)
    row = {"page_bytes": page_bytes, "pages": pages, "total_bytes": total, "chunk_pages": chunk_pages,
           "staged_gbps": statistics.median(staged), "staged_samples": staged,
           "host_paged_gbps": statistics.median(host_paged), "land_tail_us": statistics.median(tails),
           **limits, "pages_wrong": wrong}
    row["slowest_part_gbps"] = min(row["d2h_gbps"], row["h2d_gbps"], row["host_paged_gbps"])
    row["staged_x_slowest"] = row["staged_gbps"] / row["slowest_part_gbps"]
    row["staged_x_host_paged"] = row["staged_gbps"] / row["host_paged_gbps"]
    return row


def plot(rows: list[dict[str, Any]], device: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["page_bytes"] for r in rows]
    for key, label in (("staged_gbps", f"{device} -> {device}, staged (kvxfer)"),
                       ("host_paged_gbps", "host -> host paged write (kvxfer)"),
                       ("d2h_gbps", "gather + D2H into pinned"), ("h2d_gbps", "H2D from pinned + scatter")):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # the copies run 10x faster than the fabric here
    ax.set_xlabel("page size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("device pages through pinned staging, one run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = parser_from_doc(__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where both caches live: cuda (a GPU) or cpu (the same path with host copies)")
    parser.add_argument("--page-sizes", default="16K,64K,256K", help="page sizes, comma-separated, K/M suffixes")
    parser.add_argument("--total", default="256M", help="bytes pushed per pass (the cache on each side is this big)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per page size (after one warm-up)")
    parser.add_argument("--chunk-pages", type=int, default=64, help="pages per staged write (DevicePageSender)")
    parser.add_argument("--staging", default="64M", help="pinned staging bytes of the sender")
    parser.add_argument("--provider", default="net", help="libfabric provider of both engines")
    parser.add_argument("--rails", type=int, default=1, help="rails of both engines")
    parser.add_argument("--role", choices=("sender", "receiver"), default="sender",
                        help="receiver: the child process this script starts for itself")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "device_staging.json",
                        help="where the rows go (the PNG beside it)")
    args = parser.parse_args()
    if args.role == "receiver":
        serve(args.provider, args.rails, args.device)
        return
    device = torch.device(args.device)
    total = parse_size(args.total)
    receiver = ReceiverProcess(args.provider, args.rails, args.device)
    engine = make_engine(args.provider, args.rails)
    rows = []
    try:
        for page_bytes in [parse_size(s) for s in args.page_sizes.split(",")]:
            rows.append(one_page_size(engine, receiver, device, page_bytes, total, args.repeats, args.chunk_pages,
                                      parse_size(args.staging)))
            r = rows[-1]
            print(f"  {page_bytes >> 10} KiB pages done: staged {r['staged_gbps']:.2f} GB/s", flush=True)
    finally:
        receiver.close()
        engine.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.device} ({name}), {args.provider} x{args.rails} rails, {total >> 20} MiB per pass, "
          f"median of {args.repeats}:")
    print(f"{'page':>8}{'staged':>9}{'host pw':>9}{'D2H':>8}{'H2D':>8}{'x slowest':>11}{'x host pw':>11}"
          f"{'tail us':>9}{'wrong':>7}")
    for r in rows:
        print(f"{r['page_bytes'] >> 10:>5}KiB{r['staged_gbps']:>9.2f}{r['host_paged_gbps']:>9.2f}{r['d2h_gbps']:>8.2f}"
              f"{r['h2d_gbps']:>8.2f}{r['staged_x_slowest']:>11.2f}{r['staged_x_host_paged']:>11.2f}"
              f"{r['land_tail_us']:>9.0f}{r['pages_wrong']:>7}")
    print("(GB/s; host pw: host -> host paged write, same pages; x slowest: staged over the slowest of "
          "D2H, H2D and host pw; tail: from the last count or post until landed)")
    bad = [r for r in rows if r["pages_wrong"]]
    print("bytes: " + ("every page equal" if not bad else f"WRONG pages at {[r['page_bytes'] for r in bad]}"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    args.json.write_text(json.dumps({"device": args.device, "device_name": name, "provider": args.provider,
                                     "rails": args.rails, "total_bytes": total, "uptime": load, "rows": rows},
                                    indent=2))
    png = args.json.with_suffix(".png")
    plot(rows, args.device, png)
    print(f"wrote {args.json} and {png}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
