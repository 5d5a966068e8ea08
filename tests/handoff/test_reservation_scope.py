"""A reservation's scope opens all or nothing and revokes once (handoff.reservation_scope).

One real engine (net on loopback); no bytes move here. That a revoked scope's descriptor
writes nothing across processes is tested with the decoders that use it:
tests/integrations/test_vllm_connector.py (the connector) and the decode worker's tests.
"""

from __future__ import annotations


import numpy as np
import pytest

from kvxfer.errors import BoundsError
from kvxfer.handoff.reservation_scope import PrefillAddressError, ReservationScope
from kvxfer.transfer.engine import RegisteredMemory, TransferEngine

REGION_BYTES = 64 * 1024
IMM = 0x1234


@pytest.fixture()
def region(engines: tuple[TransferEngine, TransferEngine]) -> RegisteredMemory:
    return engines[0].register(np.zeros(REGION_BYTES, dtype=np.uint8))


def test_open_registers_each_part_and_revoke_closes_them_once(
    engines: tuple[TransferEngine, TransferEngine], region: RegisteredMemory
) -> None:
    decoder, prefiller = engines
    scope = ReservationScope.open(decoder, "request r1", IMM, prefiller.address,
                                  [(region, [(0, 4096), (8192, 4096)]), (region, [(32768, 128)])])
    opened = list(scope.windows)
    assert [w.ranges for w in opened] == [[(0, 4096), (8192, 4096)], [(32768, 128)]]
    assert scope.descriptors == [w.descriptor for w in opened]
    assert scope.bound_imm == (IMM if decoder.capabilities["source"] else None)

    scope.revoke()
    assert all(w.closed for w in opened)
    assert scope.windows == [] and scope.bound_imm is None
    scope.revoke()  # a second revoke (a timeout racing an admission) is harmless


def test_a_part_the_bounds_refuse_leaves_nothing_open_or_bound(
    engines: tuple[TransferEngine, TransferEngine], region: RegisteredMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder, prefiller = engines
    opened: list = []
    unbound: list[int] = []
    register = decoder.register_windows
    monkeypatch.setattr(decoder, "register_windows", lambda r, ranges: opened.append(register(r, ranges)) or opened[-1])
    monkeypatch.setattr(decoder, "unbind_imm_source", lambda imm: unbound.append(imm))
    with pytest.raises(BoundsError):
        ReservationScope.open(decoder, "request r2", IMM, prefiller.address,
                              [(region, [(0, 4096)]), (region, [(REGION_BYTES - 8, 64)])])
    assert len(opened) == 1 and opened[0].closed, "the first part stayed registered"
    assert unbound == ([IMM] if decoder.capabilities["source"] else []), "the immediate stayed bound"


def test_a_malformed_prefiller_address_is_its_own_error_and_registers_nothing(
    engines: tuple[TransferEngine, TransferEngine], region: RegisteredMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder, _ = engines
    opened: list = []
    monkeypatch.setattr(decoder, "register_windows", lambda *a: opened.append(a))
    with pytest.raises(PrefillAddressError):
        ReservationScope.open(decoder, "request r3", IMM, b"\x00not an address", [(region, [(0, 4096)])])
    assert opened == []


def test_no_address_and_no_parts_is_an_empty_scope(
    engines: tuple[TransferEngine, TransferEngine],
) -> None:
    scope = ReservationScope.open(engines[0], "request r4", IMM, None, [])
    assert scope.descriptors == [] and scope.bound_imm is None
    scope.revoke()
