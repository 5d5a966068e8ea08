"""One request on the decode worker, and the token events its /generate streams.

A request's reservation (pages, slot, immediate, nonce, and where its KV is: RESERVED,
RECEIVING, ADMITTED, FENCED, FREE) lives in one place, its `handoff.decode_ledger`
entry. A `DecodeJob` holds that entry and reads it; it keeps only what the ledger does not
know: the prompt it was reserved for, its `DecodePhase` (not decoding yet, running, or how
it ended for the client), its tokens and the queue /generate reads them from.
"""

from __future__ import annotations

import asyncio
import codecs
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, AsyncIterator, Sequence

from kvxfer.handoff.decode_ledger import LedgerEntry
from kvxfer.handoff.reservation_state import WAITING
from kvxfer.handoff.reservation_state import ReservationState as Res
from kvxfer.kv.integrity import TransferReceipt
from kvxfer.kv.protocol import pages_for_tokens
from kvxfer.workers.rejection import Rejection


class DecodePhase(str, Enum):
    """The decode side of a request: PENDING until it joins the decode batch (where its KV
    is meanwhile is its ledger entry's state), RUNNING, then the end its client is told."""

    #: Not decoding yet. The value is the word the API has always used for it ("request x is
    #: reserved"); whether its KV is awaited or admitted is the ledger entry's business.
    PENDING = "reserved"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """True for the phases a request ends in."""
        return self in (DecodePhase.DONE, DecodePhase.FAILED, DecodePhase.CANCELLED)


@dataclass
class DecodeJob:
    """One request on this decode worker: its ledger entry and its decoding."""

    request_id: str
    #: The reservation's one record (handoff.decode_ledger); the job never copies its state.
    entry: LedgerEntry
    prompt_tokens: int
    max_tokens: int
    #: Immediates the push must land: one per pushed page and layer, plus the mailbox.
    expected_count: int
    created_at: float
    #: The caller (token issuer) that reserved it: only it may generate or cancel it.
    owner: str = "anonymous"
    phase: DecodePhase = DecodePhase.PENDING
    kept: list[int] = field(default_factory=list)
    last_token: int = 0
    position: int = 0
    finish_reason: str | None = None
    error: str | None = None
    queue: "asyncio.Queue[tuple[str, Any]] | None" = None
    loop: asyncio.AbstractEventLoop | None = None
    admitted_at: float = 0.0
    # Set (in `loop`) when the request ends while /generate waits for its KV: an abort,
    # the TTL or a cancel wakes the waiter at once instead of at its deadline.
    end_signal: "asyncio.Future[None] | None" = None
    #: The Rejection the waiter raises when `end_signal` fires.
    end_reason: Rejection = Rejection.FAILED
    #: What the decoder saw of the push, once admitted (None for a local prefill).
    receipt: TransferReceipt | None = None
    #: Block hashes of the prompt's full pages (empty without a prefix cache).
    prefix_hashes: list[bytes] = field(default_factory=list)
    #: Tokens per page (the model's block size).
    block_size: int = 0
    #: The prompt's tokens (kept only with a prefix cache: generated pages are named by them).
    prompt: Sequence[int] | None = None

    # -- read from the ledger entry ------------------------------------------------------
    @property
    def reservation_state(self) -> Res:
        """Where the reservation is (FREE once the ledger let it go)."""
        return self.entry.state

    @property
    def waiting_for_kv(self) -> bool:
        """The reservation still waits for its KV (RESERVED or RECEIVING)."""
        return self.entry.state in WAITING

    @property
    def pages(self) -> list[int]:
        return self.entry.pages

    @property
    def slot(self) -> int:
        return self.entry.slot

    @property
    def imm(self) -> int:
        return self.entry.imm

    @property
    def nonce(self) -> int:
        return self.entry.nonce

    @property
    def held_pages(self) -> int:
        """Leading prompt pages reused from the prefix cache (nobody writes into them)."""
        return self.entry.held_pages

    @property
    def first_imm_at(self) -> float:
        """Monotonic time the reaper first saw one of its immediates (0: not yet), from the
        entry's history (the ledger's clock is the monotonic one)."""
        return next((at for state, at in self.entry.history if state is Res.RECEIVING), 0.0)

    # -- the request's own ---------------------------------------------------------------
    @property
    def prompt_pages(self) -> list[int]:
        """The block table's pages that hold the prompt."""
        return self.pages[:pages_for_tokens(self.prompt_tokens, self.block_size)]

    @property
    def pushed_pages(self) -> list[int]:
        """The prompt pages a prefiller writes: those after the reused prefix."""
        return self.prompt_pages[self.held_pages:]

    @property
    def live(self) -> bool:
        """Not ended: waiting for its KV or decoding (counts toward its caller's limit)."""
        return not self.phase.ended

    def emit(self, item: tuple[str, Any]) -> None:
        """Hands a token event to the /generate reading this job (from any thread)."""
        if self.loop is not None and self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


async def token_events(job: DecodeJob) -> AsyncIterator[dict[str, Any]]:
    """An admitted job's tokens as they come, then one `done` event with the usage."""
    assert job.queue is not None
    # Byte tokens of one UTF-8 character arrive one by one: decode incrementally so a
    # multi-byte character is emitted whole with its last byte, not as U+FFFD per byte.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        kind, value = await job.queue.get()
        if kind == "token":
            piece = text.decode(bytes([value])) if 0 <= value < 256 else ""
            yield {"token": value, "text": piece}
        else:
            break
    # Bytes of an unfinished character at the very end become U+FFFD, as in
    # ByteTokenizer.decode (the non-streaming answer): the done line carries that rest, so
    # the text lines plus the done line's text always equal decode(tokens).
    rest = text.decode(b"", final=True)
    usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": len(job.kept)}
    if job.phase is DecodePhase.DONE:
        yield {"done": True, "finish_reason": job.finish_reason, "text": rest, "usage": usage}
    else:
        yield {"done": True, "finish_reason": "error", "error": job.error or job.phase.value, "usage": usage}
