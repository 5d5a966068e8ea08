"""The connector's test hooks, plugged in from outside (kvxfer/integrations/vllm/connector_hooks.py).

The shared vLLM pair loads this file as its `hooks` (`connector_hooks_config`): every
instance writes what it pushed, reserved and admitted as JSON files in `digest_dir` (the
oracle compares the decoder's blocks with the prefiller's, page by page), and a prefiller
makes a fault for transfers whose id starts with `fault-<name>`, so one instance serves
healthy and faulty requests side by side:

| fault | what the prefiller does |
|---|---|
| `misplace_page` | swaps two pages of layer 0 on their way (checksums agree; the oracle must not) |
| `stall_after_layer` | posts nothing after layer `stall_after_layer` (a process that stopped without a word) |
| `slow_layers` | takes `slow_layer_ms` longer for each layer (a slow prefiller) |
| `flip_bit` | flips one bit of the first page of layer 1 after checksumming it (a corruption on the way) |

Loaded by path (the vLLM process has no tests/ on its path): it imports kvxfer only.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.vllm.connector_hooks import ConnectorHooks

if TYPE_CHECKING:  # (the structure test reads KINDS without vLLM)
    from kvxfer.integrations.vllm.kv_pusher import PrefillPush
    from kvxfer.integrations.vllm.kv_receiver import DecodeLoad
    from kvxfer.integrations.vllm.kv_region import KVRegion

#: Every fault these hooks make (tests/structure: no production module names one).
KINDS = ("misplace_page", "stall_after_layer", "slow_layers", "flip_bit")
#: The `hooks` setting that loads these hooks.
HOOKS_SPEC = f"{Path(__file__).resolve()}:ConnectorFaults"


def page_digest(raw: bytes) -> str:
    """A short, collision-resistant digest of one page (hex)."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class ConnectorFaults(ConnectorHooks):
    """Digest files in `digest_dir`, and the faults of the module's table."""

    def __init__(self, digest_dir: str, stall_after_layer: int = 1, slow_layer_ms: float = 0.0) -> None:
        self.digest_dir = Path(digest_dir)
        self.stall_after_layer = stall_after_layer
        self.slow_layer_ms = slow_layer_ms

    def __repr__(self) -> str:
        return f"ConnectorFaults({self.digest_dir}, stall_after_layer={self.stall_after_layer}, " \
               f"slow_layer_ms={self.slow_layer_ms})"

    @staticmethod
    def _armed(name: str, transfer_id: str) -> bool:
        return transfer_id.startswith(f"fault-{name}")

    def layer_saved(self, transfer_id: str, layer: int) -> None:
        if self._armed("slow_layers", transfer_id):
            time.sleep(self.slow_layer_ms / 1000.0)  # this layer's compute took longer

    def layer_pages(self, transfer_id: str, layer: int, src: list[int],
                    dst: list[int]) -> tuple[list[int], list[int]] | None:
        if self._armed("stall_after_layer", transfer_id) and layer > self.stall_after_layer:
            return None
        if self._armed("misplace_page", transfer_id) and layer == 0 and len(src) >= 2:
            # Two pages land in each other's place; checksummed in that order, so they agree.
            return [src[1], src[0], *src[2:]], dst
        return src, dst

    def layer_checksummed(self, region: KVRegion, transfer_id: str, layer: int, src: list[int]) -> None:
        if self._armed("flip_bit", transfer_id) and layer == 1 and src:
            start, length = region.geometry.runs(region.slot(layer), src[0])[0]
            assert region.buffer is not None, "flip_bit: host caches only"
            region.buffer[start + length // 2] ^= 0x04

    def push_finished(self, region: KVRegion, push: PrefillPush, tail_s: float) -> None:
        res = push.reservation
        if res is None:
            return
        # Several KV cache groups: a layer's pages are its group's blocks; None where the
        # decoder's group keeps none (a sliding window's pages before its window).
        groups = res.group_pages
        pages = [[layer, p, None if groups is not None and groups[region.group(layer)][p - res.first_page] < 0
                  else page_digest(region.page_bytes(layer, push.local_blocks(region.group(layer))[p]))]
                 for layer in range(push.num_layers) for p in range(res.first_page, push.total_pages)]
        record: dict[str, Any] = {
            "transfer_id": push.transfer_id, "role": "prefill", "pages": pages, "tail_s": tail_s,
            "caught_up_pages": push.caught_up_pages,
            "layer_saved_at": push.layer_saved_at, "layer_posted_at": push.layer_posted_at,
        }
        self._write(f"prefill-{push.transfer_id}.json", record)

    def load_reserved(self, region: KVRegion, load: DecodeLoad) -> None:
        # What a reservation hands out, for the tests that steal it.
        res = load.reservation
        if res is None:
            return
        record = {"transfer_id": load.spec.transfer_id, "descriptor": res.descriptor.hex(), "blocks": list(res.pages),
                  "num_blocks": region.num_blocks, "block_bytes": region.block_bytes,
                  "num_layers": region.num_layers}
        self._write(f"reserved-{load.spec.transfer_id}.json", record)

    def load_admitted(self, region: KVRegion, load: DecodeLoad) -> None:
        res = load.reservation
        if res is None:
            return
        groups = res.group_pages
        pages = [[layer, res.first_page + i, None if block < 0 else page_digest(region.page_bytes(layer, block))]
                 for layer in range(region.num_layers)
                 for i, block in enumerate(groups[region.group(layer)] if groups is not None else res.pages)]
        record = {"transfer_id": load.spec.transfer_id, "role": "decode", "pages": pages,
                  "admission_wait_s": time.monotonic() - load.sent_at}
        self._write(f"decode-{load.spec.transfer_id}.json", record)

    def _write(self, name: str, record: dict[str, Any]) -> None:
        # Written whole, then renamed: a test polling for the file never reads half of it.
        tmp = self.digest_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.digest_dir / name)
