"""What the connector's EngineCore half tells its worker half each step, and the transfer
parameters a request carries.

vLLM ships the step's `KvxferStepMetadata` from the scheduler process to the worker
processes itself; kvxfer puts nothing on a wire here. The request's `kv_transfer_params`
come from the HTTP client (the router): they are untrusted and parsed once, by
`TransferParams.parse`, into a typed value or a `TransferParamsError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvxfer.errors import KvxferError

_TRANSFER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_HEX = re.compile(r"^(?:[0-9a-fA-F]{2}){1,4096}$")


class TransferParamsError(KvxferError, ValueError):
    """A request's `kv_transfer_params["kvxfer"]` is malformed."""


@dataclass(frozen=True)
class TransferParams:
    """One leg of a kvxfer hand-off, as the router asks for it.

    role "decode": reserve blocks, send the reservation to `peer_engine` (the prefiller),
    admit on the ImmCounter. role "prefill": push this request's KV to the reservation
    that arrives for `transfer_id` from `peer_engine` (the decoder).
    """

    role: Literal["prefill", "decode"]
    transfer_id: str
    peer_engine: bytes
    #: decode leg: the prefiller's liveness "host:port" (prefiller_liveness.py); "": none.
    peer_liveness: str = ""

    @classmethod
    def parse(cls, params: Any) -> TransferParams | None:
        """None when the request is not a kvxfer hand-off (no "kvxfer" key)."""
        if not isinstance(params, dict) or "kvxfer" not in params:
            return None
        raw = params["kvxfer"]
        if not isinstance(raw, dict):
            raise TransferParamsError("kv_transfer_params.kvxfer must be an object")
        role = raw.get("role")
        if role not in ("prefill", "decode"):
            raise TransferParamsError(f"kv_transfer_params.kvxfer.role must be 'prefill' or 'decode', got {role!r:.40}")
        tid = raw.get("transfer_id")
        if not isinstance(tid, str) or not _TRANSFER_ID.match(tid):
            raise TransferParamsError("kv_transfer_params.kvxfer.transfer_id must be 1-128 characters of [A-Za-z0-9._:-]")
        peer = raw.get("peer_engine")
        if not isinstance(peer, str) or not _HEX.match(peer):
            raise TransferParamsError("kv_transfer_params.kvxfer.peer_engine must be the peer's engine address in hex")
        liveness = raw.get("peer_liveness", "")
        if not isinstance(liveness, str) or len(liveness) > 80:
            raise TransferParamsError("kv_transfer_params.kvxfer.peer_liveness must be a host:port string")
        return cls(role=role, transfer_id=tid, peer_engine=bytes.fromhex(peer), peer_liveness=liveness)


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: start receiving a request's prompt KV into `block_ids`."""

    request_id: str  # vLLM's id on this instance
    transfer_id: str  # the router's id, shared with the prefiller
    prefill_engine: bytes
    block_ids: list[int]  # this instance's blocks for prompt pages first_page...
    first_page: int
    prefill_liveness: str = ""  # the prefiller's liveness "host:port" ("": watched by probes only)
    #: Several KV cache groups: each group's blocks for prompt pages first_page... (-1 where
    #: the group keeps none: a sliding window's pages before its window); `block_ids` is
    #: then every block they name, once. None: one group.
    group_block_ids: list[list[int]] | None = None


@dataclass(frozen=True)
class PushSpec:
    """Prefill side: this step computes `request_id` up to `computed_end` tokens."""

    request_id: str
    transfer_id: str
    decode_engine: bytes
    prompt_tokens: int
    block_ids: list[int]  # every block of the request so far, in order
    computed_end: int
    #: Several KV cache groups: each group's blocks so far (-1: none kept); `block_ids` is
    #: group 0's. None: one group.
    group_block_ids: list[list[int]] | None = None


@dataclass
class KvxferStepMetadata(KVConnectorMetadata):
    """One step's instructions for the worker half."""

    loads: list[LoadSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)
    #: prefill requests vLLM finished whose blocks wait for the push (report them finished_sending).
    finished_pushes: list[str] = field(default_factory=list)
    #: prefill requests preempted (their blocks are gone): stop pushing.
    preempted: list[str] = field(default_factory=list)
    #: nothing is scheduled this step: the worker may block briefly on pending loads.
    idle: bool = False
    #: prefill requests wait for their reservation: the worker may block briefly on its inbox.
    awaiting_reservations: bool = False
    #: the engine got SIGTERM and drains its requests: withdraw from the registry now, so
    #: routers stop sending new ones (vLLM refuses requests added while it drains).
    draining: bool = False


@dataclass
class KvxferWorkerReport(KVConnectorWorkerMetadata):
    """Worker half to EngineCore half, each step: the transfers whose reservation arrived,
    so prefill requests are scheduled only once their destination is known (every layer's
    pages then go out as the layer is computed)."""

    reservations_arrived: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvxferWorkerReport:
        if isinstance(other, KvxferWorkerReport):
            return KvxferWorkerReport(self.reservations_arrived | other.reservations_arrived)
        return self
