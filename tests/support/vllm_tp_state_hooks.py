"""The connector's test hooks for tensor parallel instances of a Mamba hybrid
(tests/integrations/test_vllm_mamba_tp.py), plugged in from outside
(kvxfer/integrations/vllm/connector_hooks.py).

Each rank writes, as `{role}-{transfer}-r{rank}.json` in `digest_dir`, a digest of what it
pushed (prefill) or admitted (decode) per layer and prompt page: an attention layer's block
per KV head, keyed by the head's global index (`"layer/page/head"`), and a mixer layer's
state (its first `state_length` bytes, the rank's slice of the mixer: conv channels and SSM
heads) as `"layer/page/state"`, written for the one page that carries it. The oracle then
compares decode rank r with prefill rank r. The decoder makes a fault for transfers whose
id starts with `fault-wrong_rank`: each decode rank reserves at the next rank
(`head_sources` of rank + 1), so that rank's state and heads land on the wrong rank (the
oracle must fail).

Loaded by path (the vLLM process has no tests/ on its path): it imports kvxfer only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvxfer.integrations.vllm.connector_hooks import ConnectorHooks
from kvxfer.integrations.vllm.tensor_parallel import HeadSlice, TensorParallelPlace, head_sources

if TYPE_CHECKING:
    from kvxfer.integrations.vllm.kv_pusher import PrefillPush
    from kvxfer.integrations.vllm.kv_receiver import DecodeLoad
    from kvxfer.integrations.vllm.kv_region import KVRegion

#: The `hooks` setting that loads these hooks.
HOOKS_SPEC = f"{Path(__file__).resolve()}:TensorParallelStateDigests"
#: The key suffix of a mixer layer's state digest (an attention layer's is its global head).
STATE_KEY = "state"


class TensorParallelStateDigests(ConnectorHooks):
    """Per-head and per-state digest files in `digest_dir`; the `wrong_rank` fault."""

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
            self._write("prefill", push.transfer_id, self._digests(region, blocks))

    def load_admitted(self, region: KVRegion, load: DecodeLoad) -> None:
        res = load.reservation
        if res is not None:
            groups = res.group_pages if res.group_pages is not None else [list(load.spec.block_ids)]
            blocks = [{res.first_page + i: block for i, block in enumerate(ids) if block >= 0} for ids in groups]
            self._write("decode", load.spec.transfer_id, self._digests(region, blocks))

    def _digests(self, region: KVRegion, blocks: list[dict[int, int]]) -> dict[str, str]:
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

    def _write(self, role: str, transfer_id: str, digests: dict[str, str]) -> None:
        # Written whole, then renamed: a test polling for the file never reads half of it.
        name = f"{role}-{transfer_id}-r{self.place.rank}.json"
        tmp = self.digest_dir / f".{name}.tmp"
        tmp.write_text(json.dumps({"rank": self.place.rank, "size": self.place.size, "heads": digests}))
        tmp.replace(self.digest_dir / name)


def _digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
