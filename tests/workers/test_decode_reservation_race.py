"""A reservation's registration runs outside the decode worker's bookkeeping lock
(kvxfer/workers/decode/reservation_issuer.py): a cancel that arrives while it is being made
neither waits for it nor leaves it open.

One in-process decoder (tiny model, net provider on loopback), shared by the module.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from kvxfer.workers.decode.service import DecodeService, DecodeSettings
from kvxfer.workers.rejection import Rejection, RequestRejected

#: How long the cancel may take while the registration is held up; it takes no time at all
#: unless it waits for the registration (then it never returns before this).
CANCEL_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def decode() -> Iterator[DecodeService]:
    service = DecodeService(DecodeSettings(model="tiny", provider="net", bind_host="127.0.0.1", num_pages=64,
                                           max_requests=4))
    try:
        yield service
    finally:
        service.close()


def test_a_cancel_during_the_registration_is_not_held_up_and_leaves_nothing_open(
    decode: DecodeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = decode.core.engine
    register = engine.register_windows
    opened: list[Any] = []
    cancels: list[dict[str, Any]] = []

    def register_while_a_cancel_arrives(region: Any, ranges: Any) -> Any:
        if not opened:  # the reservation's first registration: its cancel comes meanwhile
            canceller = threading.Thread(target=lambda: cancels.append(decode.cancel("raced", prefill_stopped=True)))
            canceller.start()
            canceller.join(timeout=CANCEL_DEADLINE_S)
        opened.append(register(region, ranges))
        return opened[-1]

    monkeypatch.setattr(engine, "register_windows", register_while_a_cancel_arrives)
    with pytest.raises(RequestRejected) as refused:
        decode.reserve("raced", 20, 4)
    assert cancels == [{"request_id": "raced", "state": "free", "known": True}], \
        "the cancel waited for the registration"
    assert refused.value.reason is Rejection.CONFLICT, refused.value
    assert opened and all(w.closed for w in opened), "a registration of the cancelled reservation stayed open"
    assert "raced" not in decode.jobs
    assert decode.allocator.free_pages == decode.allocator.total_pages

    monkeypatch.undo()
    again = decode.reserve("raced", 20, 4)  # nothing of the first attempt is left to collide with
    assert decode.job("raced").imm == again.imm
    decode.cancel("raced", prefill_stopped=True)
    assert decode.allocator.free_pages == decode.allocator.total_pages
