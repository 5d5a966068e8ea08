"""Injection points of the connector's worker half, given from outside (as handoff.push_hooks is
for the builtin workers): how tests and drills slow, stop or corrupt a push, or read what
a push sent and a load admitted, with no branch for them in the pusher or the receiver.

`WorkerSide` loads the hooks the `hooks` setting names ("module:callable" or
"file.py:callable", called with `hooks_config`; handoff.push_hooks.load_hooks) and hands them
to the pusher and the receiver at construction; without the setting they get this base
class, which does nothing. Every method is called on vLLM's worker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_pusher import PrefillPush
    from .kv_receiver import DecodeLoad
    from .kv_region import KVRegion
    from .tensor_parallel import HeadSlice, TensorParallelPlace


class ConnectorHooks:
    """Called by the pusher (prefill legs) and the receiver (decode legs); does nothing here."""

    def placed(self, place: TensorParallelPlace) -> None:
        """This worker's tensor parallel rank and the model's KV heads, once, before any transfer."""

    def layer_saved(self, transfer_id: str, layer: int) -> None:
        """vLLM computed `layer` of this push's step; its pages are posted after this returns."""

    def layer_pages(self, transfer_id: str, layer: int, src: list[int],
                    dst: list[int]) -> tuple[list[int], list[int]] | None:
        """The (local, reserved) blocks of `layer` about to be checksummed and posted, in
        pairs; None posts nothing of the layer now (as if the prefiller had stopped)."""
        return src, dst

    def layer_checksummed(self, region: KVRegion, transfer_id: str, layer: int, src: list[int]) -> None:
        """The checksums of `src` (blocks of `layer`) were taken, where the reservation asks
        for them; their writes are posted next."""

    def push_finished(self, region: KVRegion, push: PrefillPush, tail_s: float) -> None:
        """Every write of `push` landed (`tail_s`: its last layer's compute to its last write)."""

    def head_sources(self, transfer_id: str, prefill_tp: int, sources: list[HeadSlice]) -> list[HeadSlice]:
        """Which rank of the prefiller (of `prefill_tp` ranks) gives which heads to this
        decode rank (tensor_parallel.py's plan), before the reservations go out; what is
        returned is asked for."""
        return sources

    def load_reserved(self, region: KVRegion, load: DecodeLoad) -> None:
        """`load`'s reservation is made and about to be sent to the prefiller."""

    def load_admitted(self, region: KVRegion, load: DecodeLoad) -> None:
        """`load`'s blocks landed and passed the checks; vLLM is told next."""


#: The hooks of a connector nobody hooks into.
NO_CONNECTOR_HOOKS = ConnectorHooks()
