"""The connector's test hooks for tensor parallel instances (tests/integrations/test_vllm_tp.py,
test_vllm_mamba_tp.py),
plugged in from outside (kvxfer/integrations/vllm/connector_hooks.py).

Each rank writes a digest of every KV head of every block it pushed (prefill) or admitted
(decode) to `digest_dir`, as `{role}-{transfer}-r{rank}.json`, keyed by the head's global
index: the oracle then compares heads across ranks of different TP sizes. With several KV
cache groups (a hybrid model) a layer's blocks are its group's, and a page its group keeps
none of on the decoder (-1 in the reservation's `group_pages`) has no digest. A Mamba/SSM
mixer layer's state (its first `state_length` bytes: the rank's slice of conv channels and
SSM heads, which no head index names) has one digest, keyed `"layer/page/state"`
(`STATE_KEY`), for the one page that carries it. The decoder makes
a fault for transfers whose id starts with `fault-wrong_rank`: each decode rank asks for
the heads of the next rank (`head_sources` of rank + 1), so a head slice lands on the wrong
rank (the oracle must fail).

Loaded by path (the vLLM process has no tests/ on its path): it imports kvxfer only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.vllm.connector_hooks import ConnectorHooks
from kvxfer.integrations.vllm.tensor_parallel import HeadSlice, TensorParallelPlace, head_sources

if TYPE_CHECKING:
    from kvxfer.integrations.vllm.kv_pusher import PrefillPush
    from kvxfer.integrations.vllm.kv_receiver import DecodeLoad
    from kvxfer.integrations.vllm.kv_region import KVRegion

#: The `hooks` setting that loads these hooks.
HOOKS_SPEC = f"{Path(__file__).resolve()}:TensorParallelDigests"
#: The key suffix of a mixer layer's state digest (an attention layer's is its global head).
STATE_KEY = "state"


class TensorParallelDigests(ConnectorHooks):
    """Per-head (and per-state) digest files in `digest_dir`; the `wrong_rank` fault."""

    def __init__(self, digest_dir: str) -> None:
        self.digest_dir = Path(digest_dir)
        self.place = TensorParallelPlace()

    def placed(self, place: TensorParallelPlace) -> None:
        self.place = place

    def head_sources(self, transfer_id: str, prefill_tp: int, sources: list[HeadSlice]) -> list[HeadSlice]:
        if not transfer_id.startswith("fault-wrong_rank") or self.place.size == 1:
            return sources
        wrong = (self.place.rank + 1) % self.place.size
        return head_sources(self.place.total_kv_heads, prefill_tp, self.place.size, wrong)

    def push_finished(self, region: KVRegion, push: PrefillPush, tail_s: float) -> None:
        res = push.reservation
        if res is not None:
            kept = res.group_pages
            blocks = [{p: push.local_blocks(g)[p] for p in range(res.first_page, push.total_pages)
                       if kept is None or kept[g][p - res.first_page] >= 0} for g in range(region.num_groups)]
            self._write("prefill", push.transfer_id, self._heads(region, blocks))

    def load_admitted(self, region: KVRegion, load: DecodeLoad) -> None:
        res = load.reservation
        if res is not None:
            groups = res.group_pages if res.group_pages is not None else [list(load.spec.block_ids)]
            blocks = [{res.first_page + i: block for i, block in enumerate(ids) if block >= 0} for ids in groups]
            self._write("decode", load.spec.transfer_id, self._heads(region, blocks))

    def _heads(self, region: KVRegion, blocks: list[dict[int, int]]) -> dict[str, str]:
        """{"layer/page/key": digest} of each layer's blocks (per KV cache group: prompt page
        -> block): per global KV head for attention layers, the state for mixer layers."""
        assert region.buffer is not None, "host caches only"
        first = self.place.heads[0]
        out: dict[str, str] = {}
        for layer in range(region.num_layers):
            for page, block in blocks[region.group(layer)].items():
                if region.state_length(layer):
                    out[f"{layer}/{page}/{STATE_KEY}"] = _digest(region.page_bytes(layer, block))
                    continue
                for h in range(region.geometry.num_heads):
                    out[f"{layer}/{page}/{first + h}"] = _digest(region.page_bytes(layer, block, (h, h + 1)))
        return out

    def _write(self, role: str, transfer_id: str, heads: dict[str, Any]) -> None:
        # Written whole, then renamed: a test polling for the file never reads half of it.
        name = f"{role}-{transfer_id}-r{self.place.rank}.json"
        tmp = self.digest_dir / f".{name}.tmp"
        tmp.write_text(json.dumps({"rank": self.place.rank, "size": self.place.size, "heads": heads}))
        tmp.replace(self.digest_dir / name)


def _digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
