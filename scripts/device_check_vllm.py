"""The vLLM connector's worker halves between processes, with KV caches on a device.

The prefill half (this process) and two decode halves (spawned processes, decode ranks 0
and 1) each hold a KV cache laid out as vLLM's workers lay it out
(tests/support/vllm_kv_caches.py), their own transfer engine, and the connector's pusher or
receiver, driven as vLLM's worker drives them: the decoder reserves and sends the
reservation over the fabric, the prefiller computes every layer (save_kv_layer) and
pushes, the decoder admits on its immediate count. On CUDA every cache moves through
pinned staging (kvxfer/integrations/vllm/cache_paths.py). For each case each decode rank
compares every moved block with the prefiller's digests of the heads that rank serves, byte
for byte, and checks that no other byte of its cache changed.

Cases, prefill tensor parallel size 1 into decode size 1 (decode rank 0 only): FlashAttention
content (K and V per head) in LBHNC, the layout the connector asks vLLM for, and in BLHNC
(cross-layer blocks); MLA content (one latent vector per token) in LBHNC and BLHNC. Into
decode size 2 (both decode ranks, each with its own engine): FlashAttention in LBHNC and
BLHNC, each rank taking its half of the KV heads (a head slice of every block), and MLA in
LBHNC, each rank taking the whole latent (vLLM replicates MLA's KV over its ranks).

    python3 scripts/device_check_vllm.py [--device cuda|cpu] [--staged] [--json OUT]

Needs vLLM importable (its layout and view code are the oracle). Exits non-zero when a case
fails. Bounded: every wait has a deadline (--deadline-s per hand-off, REPLY_WAIT_S for a
half's reply).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

#: (case name, layout, content, decode tensor parallel size); the prefiller runs size 1.
CASES = [("flashattention-lbhnc", "LBHNC", "attention", 1), ("flashattention-blhnc", "BLHNC", "attention", 1),
         ("mla-lbhnc", "LBHNC", "mla", 1), ("mla-blhnc", "BLHNC", "mla", 1),
         ("flashattention-lbhnc-tp1into2", "LBHNC", "attention", 2),
         ("flashattention-blhnc-tp1into2", "BLHNC", "attention", 2),
         ("mla-lbhnc-tp1into2", "LBHNC", "mla", 2)]
#: Decode ranks started: enough for the widest case.
DECODE_RANKS = max(tp for *_, tp in CASES)
#: How long one half waits for the other's reply, seconds: a hand-off, or a decode half's start.
REPLY_WAIT_S = 120.0


def _total_heads(content: str, heads: int) -> int:
    """KV heads over every rank: MLA's latent is one head slot, the same on every rank."""
    return 1 if content == "mla" else heads


def _spec(content: str, tokens: int, heads: int) -> Any:
    from support.vllm_kv_caches import attention_spec, mla_spec

    return mla_spec(tokens) if content == "mla" else attention_spec(heads=heads, tokens=tokens)


def _digest(view: Any) -> str:
    import torch

    return hashlib.blake2b(view.contiguous().view(torch.uint8).cpu().numpy().tobytes(), digest_size=16).hexdigest()


def _moved_mask(cache: Any, blocks: list[int], layers: int) -> Any:
    """The bytes of `blocks` of every layer, as vLLM's views address them: each view's
    strides laid over a zeroed host copy of the allocation, and its bytes marked."""
    import torch

    mask = torch.zeros(cache.raw.numel() * cache.raw.element_size(), dtype=torch.uint8)
    for layer in range(layers):
        view = cache.views[layer]
        typed = mask.view(view.dtype)
        for block in blocks:
            cell = view[block]
            torch.as_strided(typed, cell.size(), cell.stride(), cell.storage_offset()).view(torch.uint8).fill_(1)
    return mask.numpy().astype(bool)


def decode_process(conn: Any, args: dict[str, Any]) -> None:
    """One decode rank: one cache per case it takes part in, the receiver (whole blocks from
    the prefill rank of its size, or sliced reservations to the prefill ranks that hold its
    heads), and the checks after admission."""
    from dataclasses import replace

    from support.connector_halves import decode_half, halves_engine
    from support.vllm_kv_caches import vllm_cache
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvxfer.integrations.vllm.kv_checksums import decode_table
    from kvxfer.integrations.vllm.metadata import LoadSpec
    from kvxfer.integrations.vllm.settings import ConnectorSettings
    from kvxfer.integrations.vllm.sliced_reservation import SliceTarget
    from kvxfer.integrations.vllm.tensor_parallel import decode_rank_addresses, head_sources
    from kvxfer.kv.protocol import decode_abort

    rank = args["rank"]
    engine = halves_engine(args["provider"])
    conn.send({"address": engine.address.hex()})
    settings = ConnectorSettings(provider=args["provider"])
    while True:
        msg = conn.recv()
        if msg is None:
            break
        tp = msg["decode_tp"]
        total = _total_heads(msg["content"], args["heads"])
        spec = _spec(msg["content"], args["tokens"], max(1, total // tp))
        cache = vllm_cache(KVCacheLayout[msg["layout"]], spec, args["dst_blocks"], seed=msg["seed"] + rank,
                           device=args["device"], layers=args["layers"])
        before = cache.host_bytes().copy()
        receiver = decode_half(engine, cache.region, settings, staged=args["device"] != "cpu" or args["staged"],
                               landing_blocks=args["landing_blocks"])
        request = f"decode-{msg['transfer_id']}"
        prefill = bytes.fromhex(msg["prefill"])
        prefill_ranks = decode_rank_addresses(prefill)
        load = LoadSpec(request, msg["transfer_id"], prefill, msg["dst"], 0)
        if len(prefill_ranks) == tp:
            receiver.start(replace(load, prefill_engine=prefill_ranks[rank]))
        else:
            heads = cache.region.geometry.num_heads
            receiver.start(load, [(prefill_ranks[s.src_rank], SliceTarget(rank, tp, s, heads))
                                  for s in head_sources(total, len(prefill_ranks), tp, rank)])
        conn.send({"reserved": True})
        end = time.monotonic() + args["deadline_s"]
        outcome = "timeout"
        while time.monotonic() < end:
            raw = engine.recv(0.0)
            if raw is not None:  # the prefiller's checksum table (kv_integrity), or its abort
                table, stopped = decode_table(bytes(raw)), decode_abort(bytes(raw))
                if table is not None:
                    receiver.on_checksum_table(table)
                elif stopped is not None:
                    receiver.on_prefill_stopped(*stopped)
            reason = receiver.failure(request)
            finished, failed = receiver.poll(set())
            if request in finished:
                outcome = f"failed: {reason}" if request in failed else "admitted"
                break
            time.sleep(0.001)
        digests = [[_digest(cache.views[layer][d]) for d in msg["dst"]] for layer in range(args["layers"])]
        moved = _moved_mask(cache, msg["dst"], args["layers"])
        untouched = bool((cache.host_bytes()[~moved] == before[~moved]).all())
        conn.send({"outcome": outcome, "digests": digests, "untouched": untouched,
                   "kv_layout": cache.region.kv_layout})
    engine.close()


def _reservations(engine: Any, pusher: Any, wanted: int, end: float) -> int:
    """Hands the pusher the decode ranks' reservations (whole blocks, or sliced) until
    `wanted` arrived or `end` (time.monotonic()) passed; how many arrived."""
    from kvxfer.integrations.vllm.sliced_reservation import decode_sliced_reservation
    from kvxfer.kv.protocol import decode_reservation_message

    arrived = 0
    while arrived < wanted and time.monotonic() < end:
        raw = engine.recv(0.05)
        if raw is None:
            continue
        sliced = decode_sliced_reservation(bytes(raw), 0)
        if sliced is not None:
            pusher.on_reservation(sliced[1], sliced[0])
            arrived += 1
            continue
        reservation = decode_reservation_message(bytes(raw))
        if reservation is not None:
            pusher.on_reservation(reservation)
            arrived += 1
    return arrived


def run_case(conns: list[Any], engine: Any, case: tuple[str, str, str, int], args: argparse.Namespace,
             decode_addresses: list[bytes]) -> dict[str, Any]:
    """One hand-off from the prefill rank into decode ranks 0..tp-1; their verdicts on it."""
    import numpy as np
    from support.vllm_kv_caches import vllm_cache
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvxfer.integrations.vllm.cache_paths import DirectWrites, StagedWrites
    from kvxfer.integrations.vllm.kv_pusher import KVPusher
    from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, PushSpec
    from kvxfer.integrations.vllm.settings import ConnectorSettings
    from kvxfer.integrations.vllm.tensor_parallel import TensorParallelPlace, encode_rank_addresses, rank_heads
    from kvxfer.kv.protocol import decode_cancel
    from kvxfer.metrics import ConnectorMetrics

    name, layout, content, tp = case
    total = _total_heads(content, args.heads)
    rng = np.random.default_rng(7)
    src = sorted(rng.choice(args.src_blocks, args.request_blocks, replace=False).tolist())
    dst = rng.choice(args.dst_blocks, args.request_blocks, replace=False).tolist()
    cache = vllm_cache(KVCacheLayout[layout], _spec(content, args.tokens, total), args.src_blocks, seed=1,
                       device=args.device, layers=args.layers)
    region = cache.region
    writes = (StagedWrites(engine, region, staging_rows=args.request_blocks) if args.device != "cpu" or args.staged
              else DirectWrites(engine, engine.register(region.buffer), region.geometry))
    pusher = KVPusher(ConnectorSettings(provider=args.provider), engine, region, None,
                      ConnectorMetrics("kv_producer"), writes=writes, place=TensorParallelPlace(0, 1, total))
    started = time.monotonic()
    for conn in conns[:tp]:
        conn.send({"layout": layout, "content": content, "seed": 2, "transfer_id": name, "dst": dst,
                   "prefill": engine.address.hex(), "decode_tp": tp})
    for rank, conn in enumerate(conns[:tp]):
        if not conn.poll(REPLY_WAIT_S):
            return {"case": name, "ok": False, "why": f"decode rank {rank} did not reserve"}
        conn.recv()
    tokens = args.request_blocks * args.tokens
    decode_engine = encode_rank_addresses(decode_addresses[:tp])
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"prefill-{name}", name, decode_engine, tokens, src, tokens)]))
    end = time.monotonic() + args.deadline_s
    arrived = _reservations(engine, pusher, tp, end)
    for layer in range(args.layers):
        pusher.save_layer(layer)
    while time.monotonic() < end and not all(conn.poll(0) for conn in conns[:tp]):
        raw = engine.recv(0.0)
        cancel = decode_cancel(bytes(raw)) if raw is not None else None
        if cancel is not None:  # a decode rank gave up (a failed check): confirm once drained
            pusher.on_cancel(*cancel)
        pusher.poll(set())
        time.sleep(0.001)
    verdicts = []
    for rank, conn in enumerate(conns[:tp]):
        if not conn.poll(REPLY_WAIT_S):
            return {"case": name, "ok": False, "why": f"no verdict from decode rank {rank}"}
        verdicts.append(conn.recv())
    ranks = []
    for rank, verdict in enumerate(verdicts):
        h0, h1 = rank_heads(total, tp, rank)
        # This rank's heads of every moved block (MLA: heads 0..1, the whole latent, replicated).
        expected = [[_digest(cache.views[layer][s][h0:h1]) for s in src] for layer in range(args.layers)]
        ranks.append({"rank": rank, "heads": [h0, h1], "outcome": verdict["outcome"],
                      "blocks_equal": verdict["digests"] == expected, "other_bytes_untouched": verdict["untouched"],
                      "kv_layout": verdict["kv_layout"]})
    ok = arrived == tp and all(r["outcome"] == "admitted" and r["blocks_equal"] and r["other_bytes_untouched"]
                               for r in ranks)
    return {"case": name, "ok": ok, "decode_tp": tp, "ranks": ranks,
            "bytes_moved": args.layers * args.request_blocks * region.block_bytes,
            "seconds": round(time.monotonic() - started, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="where every cache lives: cuda, or cpu (the same "
                        "check on host tensors)")
    parser.add_argument("--staged", action="store_true", help="on cpu, move host caches through the staging "
                        "path too, as on cuda (always on cuda)")
    parser.add_argument("--provider", default="auto", help="libfabric provider of every engine")
    parser.add_argument("--layers", type=int, default=8, help="attention layers per cache")
    parser.add_argument("--heads", type=int, default=8, help="KV heads over every rank (FlashAttention content; "
                        "even, so that two decode ranks split them)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per block")
    parser.add_argument("--src-blocks", type=int, default=512, help="blocks of the prefill cache")
    parser.add_argument("--dst-blocks", type=int, default=640, help="blocks of each decode rank's cache")
    parser.add_argument("--request-blocks", type=int, default=128, help="blocks one request moves")
    parser.add_argument("--cases", default="", help="comma-separated case names to run (default: all: "
                        + ", ".join(c[0] for c in CASES) + ")")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="most one hand-off may take, seconds")
    parser.add_argument("--json", type=Path, help="write the verdicts here")
    args = parser.parse_args()
    if args.request_blocks > min(args.src_blocks, args.dst_blocks):
        parser.error("--request-blocks exceeds a cache")
    if args.heads % DECODE_RANKS:
        parser.error(f"--heads must split over {DECODE_RANKS} decode ranks")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (--device cpu runs the check on host tensors)")
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    if not cases:
        parser.error(f"--cases names none of {[c[0] for c in CASES]}")
    from support.connector_halves import halves_engine

    ctx = mp.get_context("spawn")
    conns, peers = [], []
    for rank in range(max(tp for *_, tp in cases)):
        parent, child = ctx.Pipe()
        peer = ctx.Process(target=decode_process, args=(child, {
            "rank": rank, "provider": args.provider, "device": args.device, "staged": args.staged,
            "layers": args.layers, "heads": args.heads, "tokens": args.tokens, "dst_blocks": args.dst_blocks,
            "deadline_s": args.deadline_s, "landing_blocks": args.request_blocks}))
        peer.start()
        conns.append(parent)
        peers.append(peer)
    results: list[dict[str, Any]] = []
    engine = halves_engine(args.provider)
    try:
        addresses = []
        for rank, conn in enumerate(conns):
            if not conn.poll(REPLY_WAIT_S):
                print(f"decode rank {rank} did not start", file=sys.stderr)
                return 1
            addresses.append(bytes.fromhex(conn.recv()["address"]))
        for case in cases:
            result = run_case(conns, engine, case, args, addresses)
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        for conn in conns:
            try:
                conn.send(None)
            except OSError:
                pass  # that decode half is gone already
        for peer in peers:
            peer.join(REPLY_WAIT_S)
            if peer.is_alive():
                peer.kill()
        engine.close()
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "results": results}, indent=2))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
