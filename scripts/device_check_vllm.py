"""The vLLM connector's worker halves between two processes, with KV caches on a device.

The prefill half (this process) and the decode half (a spawned process) each hold a KV
cache laid out as vLLM's workers lay it out (tests/support/vllm_kv_caches.py), their own
transfer engine, and the connector's pusher or receiver, driven as vLLM's worker drives them:
the decoder reserves and sends the reservation over the fabric, the prefiller computes every
layer (save_kv_layer) and pushes, the decoder admits on its immediate count. On CUDA both
caches move through pinned staging (kvxfer/integrations/vllm/cache_paths.py). For each
case the decoder compares every moved block with the prefiller's digests, byte for byte,
and checks that no other byte of its cache changed. Cases: FlashAttention content (K and
V per head) in LBHNC, the layout the connector asks vLLM for, and in BLHNC (cross-layer
blocks); MLA content (one latent vector per token) in LBHNC and BLHNC.

    python3 scripts/device_check_vllm.py [--device cuda] [--blocks 512] [--json OUT]

Needs vLLM importable (its layout and view code are the oracle). Exits non-zero when a case
fails. Bounded: every wait has a deadline (--deadline-s per hand-off).
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

#: (case name, layout, content)
CASES = [("flashattention-lbhnc", "LBHNC", "attention"), ("flashattention-blhnc", "BLHNC", "attention"),
         ("mla-lbhnc", "LBHNC", "mla"), ("mla-blhnc", "BLHNC", "mla")]
#: How long one half waits for the other's reply, seconds: a hand-off, or the decode half's start.
REPLY_WAIT_S = 120.0


def _spec(content: str, tokens: int, heads: int) -> Any:
    from support.vllm_kv_caches import attention_spec, mla_spec

    return mla_spec(tokens) if content == "mla" else attention_spec(heads=heads, tokens=tokens)


def _digest(view: Any) -> str:
    import torch

    return hashlib.blake2b(view.contiguous().view(torch.uint8).cpu().numpy().tobytes(), digest_size=16).hexdigest()


def decode_process(conn: Any, args: dict[str, Any]) -> None:
    """The decode half: one cache per case, the receiver, and the checks after admission."""
    import numpy as np
    from support.connector_halves import decode_half, halves_engine
    from support.vllm_kv_caches import mask_of, vllm_cache
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvxfer.integrations.vllm.kv_checksums import decode_table
    from kvxfer.integrations.vllm.metadata import LoadSpec
    from kvxfer.integrations.vllm.settings import ConnectorSettings
    from kvxfer.kv.protocol import decode_abort

    engine = halves_engine(args["provider"])
    conn.send({"address": engine.address.hex()})
    settings = ConnectorSettings(provider=args["provider"])
    while True:
        msg = conn.recv()
        if msg is None:
            break
        spec = _spec(msg["content"], args["tokens"], args["heads"])
        cache = vllm_cache(KVCacheLayout[msg["layout"]], spec, args["dst_blocks"], seed=msg["seed"],
                           device=args["device"], layers=args["layers"])
        before = cache.host_bytes().copy()
        receiver = decode_half(engine, cache.region, settings, staged=args["device"] != "cpu" or args["staged"],
                               landing_blocks=args["landing_blocks"])
        request = f"decode-{msg['transfer_id']}"
        receiver.start(LoadSpec(request, msg["transfer_id"], bytes.fromhex(msg["prefill"]), msg["dst"], 0))
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
            finished, failed = receiver.poll(set())
            if request in finished:
                outcome = "failed" if request in failed else "admitted"
                break
            time.sleep(0.001)
        digests = [[_digest(cache.views[layer][d]) for d in msg["dst"]] for layer in range(args["layers"])]
        moved = np.zeros(before.size, dtype=bool)
        for layer in range(args["layers"]):
            for d in msg["dst"]:
                moved |= mask_of(cache.cells(layer, d), before.size)
        untouched = bool((cache.host_bytes()[~moved] == before[~moved]).all())
        conn.send({"outcome": outcome, "digests": digests, "untouched": untouched,
                   "signature": cache.region.signature})
    engine.close()


def run_case(conn: Any, engine: Any, name: str, layout: str, content: str, args: argparse.Namespace,
             decode_address: bytes) -> dict[str, Any]:
    """One hand-off; the decoder's verdict on it."""
    import numpy as np
    from support.connector_halves import prefill_half
    from support.vllm_kv_caches import vllm_cache
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvxfer.integrations.vllm.metadata import KvxferStepMetadata, PushSpec
    from kvxfer.integrations.vllm.settings import ConnectorSettings
    from kvxfer.kv.protocol import decode_reservation_message

    rng = np.random.default_rng(7)
    src = sorted(rng.choice(args.src_blocks, args.request_blocks, replace=False).tolist())
    dst = rng.choice(args.dst_blocks, args.request_blocks, replace=False).tolist()
    cache = vllm_cache(KVCacheLayout[layout], _spec(content, args.tokens, args.heads), args.src_blocks, seed=1,
                       device=args.device, layers=args.layers)
    pusher = prefill_half(engine, cache.region, ConnectorSettings(provider=args.provider),
                          staged=args.device != "cpu" or args.staged)
    started = time.monotonic()
    conn.send({"layout": layout, "content": content, "seed": 2, "transfer_id": name, "dst": dst,
               "prefill": engine.address.hex()})
    if not conn.poll(REPLY_WAIT_S):
        return {"case": name, "ok": False, "why": "the decode half did not reserve"}
    conn.recv()
    tokens = args.request_blocks * args.tokens
    pusher.on_step(KvxferStepMetadata(pushes=[PushSpec(f"prefill-{name}", name, decode_address, tokens, src, tokens)]))
    end = time.monotonic() + args.deadline_s
    while time.monotonic() < end:
        raw = engine.recv(0.05)
        reservation = decode_reservation_message(bytes(raw)) if raw is not None else None
        if reservation is not None:
            pusher.on_reservation(reservation)
            break
    for layer in range(args.layers):
        pusher.save_layer(layer)
    while time.monotonic() < end and not conn.poll(0):
        pusher.poll(set())
        time.sleep(0.001)
    if not conn.poll(REPLY_WAIT_S):
        return {"case": name, "ok": False, "why": "no verdict from the decode half"}
    verdict = conn.recv()
    expected = [[_digest(cache.views[layer][s]) for s in src] for layer in range(args.layers)]
    same = verdict["digests"] == expected
    ok = verdict["outcome"] == "admitted" and same and verdict["untouched"]
    return {"case": name, "ok": ok, "outcome": verdict["outcome"], "blocks_equal": same,
            "other_bytes_untouched": verdict["untouched"], "signature": verdict["signature"],
            "bytes_moved": args.layers * args.request_blocks * cache.region.block_bytes,
            "seconds": round(time.monotonic() - started, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="where both caches live: cuda, or cpu (the same "
                        "two-process check on host tensors)")
    parser.add_argument("--staged", action="store_true", help="on cpu, move host caches through the staging "
                        "path too (always on cuda)")
    parser.add_argument("--provider", default="auto", help="libfabric provider of both engines")
    parser.add_argument("--layers", type=int, default=8, help="attention layers per cache")
    parser.add_argument("--heads", type=int, default=8, help="KV heads (FlashAttention content)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per block")
    parser.add_argument("--src-blocks", type=int, default=512, help="blocks of the prefill cache")
    parser.add_argument("--dst-blocks", type=int, default=640, help="blocks of the decode cache")
    parser.add_argument("--request-blocks", type=int, default=128, help="blocks one request moves")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="most one hand-off may take, seconds")
    parser.add_argument("--json", type=Path, help="write the verdicts here")
    args = parser.parse_args()
    if args.request_blocks > min(args.src_blocks, args.dst_blocks):
        parser.error("--request-blocks exceeds a cache")
    from support.connector_halves import halves_engine

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=decode_process, args=(child, {
        "provider": args.provider, "device": args.device, "staged": args.staged, "layers": args.layers,
        "heads": args.heads, "tokens": args.tokens, "dst_blocks": args.dst_blocks, "deadline_s": args.deadline_s,
        "landing_blocks": args.request_blocks}))
    peer.start()
    results: list[dict[str, Any]] = []
    engine = halves_engine(args.provider)
    try:
        if not parent.poll(REPLY_WAIT_S):
            print("the decode half did not start", file=sys.stderr)
            return 1
        decode_address = bytes.fromhex(parent.recv()["address"])
        for name, layout, content in CASES:
            result = run_case(parent, engine, name, layout, content, args, decode_address)
            print(json.dumps(result), flush=True)
            results.append(result)
        parent.send(None)
    finally:
        peer.join(REPLY_WAIT_S)
        if peer.is_alive():
            peer.kill()
        engine.close()
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "results": results}, indent=2))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
