"""The admission step both decoders run once every write landed
(kvxfer.handoff.admission.check_landed): the count first, then the sender's declared total,
then the checksums per kv_integrity."""

from __future__ import annotations

import pytest

from kvxfer.handoff.admission import check_landed
from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError, Verification


class Verifier:
    """A `verify` that returns a set verification and counts its calls."""

    def __init__(self, verification: Verification) -> None:
        self.verification = verification
        self.calls = 0

    def __call__(self) -> Verification:
        self.calls += 1
        return self.verification


@pytest.mark.parametrize("mode", list(KVIntegrity), ids=lambda m: m.value)
def test_a_count_above_the_expected_one_fails_before_any_checksum_is_read(mode: KVIntegrity) -> None:
    verify = Verifier(Verification(checked=8))
    with pytest.raises(KVIntegrityError, match=r"request r: .*\(write_overcount\): 9 writes counted, the "
                       r"reservation expects 8: a page was written twice") as caught:
        check_landed("r", 9, 8, mode, verify)
    assert caught.value.reason == "write_overcount" and verify.calls == 0


@pytest.mark.parametrize("mode", list(KVIntegrity), ids=lambda m: m.value)
def test_an_exact_count_with_one_more_write_declared_fails_before_any_checksum_is_read(mode: KVIntegrity) -> None:
    """A page written twice, its extra write (or its mailbox's) not counted yet: the count
    is exact, the sender's own total is one above it."""
    verify = Verifier(Verification(checked=8))
    with pytest.raises(KVIntegrityError, match=r"request r: .*\(write_overcount\): the sender posted 9 writes, the "
                       r"reservation expects 8 and 8 were counted so far: a page was written twice") as caught:
        check_landed("r", 8, 8, mode, verify, declared=9)
    assert caught.value.reason == "write_overcount" and verify.calls == 0


def test_fewer_writes_declared_than_counted_means_a_write_from_elsewhere() -> None:
    with pytest.raises(KVIntegrityError, match=r"\(write_overcount\): the sender posted 7 writes, .*: a write "
                       r"came from elsewhere"):
        check_landed("r", 8, 8, KVIntegrity.FULL, Verifier(Verification()), declared=7)


def test_the_declared_total_equal_to_the_count_admits() -> None:
    assert check_landed("r", 8, 8, KVIntegrity.SAMPLED, Verifier(Verification(checked=3)), declared=8).checked == 3


def test_a_mismatch_names_its_first_layer_block_and_page() -> None:
    verify = Verifier(Verification(checked=16, mismatches=[(1, 3, 42), (2, 0, 7)]))
    with pytest.raises(KVIntegrityError, match=r"\(checksum_mismatch\): 2 of 16 checked pages differ from the "
                       r"prefiller's CRC-32C; first: layer 1, block 3, page 42") as caught:
        check_landed("r", 8, 8, KVIntegrity.FULL, verify)
    assert caught.value.reason == "checksum_mismatch"


def test_a_failure_the_verifier_raises_itself_passes_through() -> None:
    def verify() -> Verification:
        raise KVIntegrityError("r", "checksums_missing", "the table did not arrive")

    with pytest.raises(KVIntegrityError, match="checksums_missing"):
        check_landed("r", 8, 8, KVIntegrity.SAMPLED, verify)


def test_equal_checksums_admit_and_say_what_was_checked() -> None:
    ticks = iter([10.0, 10.25])
    checked = check_landed("r", 8, 8, KVIntegrity.SAMPLED, Verifier(Verification(checked=3)),
                           clock=lambda: next(ticks))
    assert (checked.checked, checked.verify_s) == (3, 0.25)


def test_with_kv_integrity_off_nothing_is_verified() -> None:
    verify = Verifier(Verification(checked=3, mismatches=[(0, 0, 0)]))
    assert check_landed("r", 8, 8, KVIntegrity.OFF, verify).checked == 0 and verify.calls == 0


def test_admission_before_every_write_landed_is_a_callers_bug() -> None:
    with pytest.raises(ValueError, match="7 of 8 writes landed"):
        check_landed("r", 7, 8, KVIntegrity.FULL, Verifier(Verification()))
