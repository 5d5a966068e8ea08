"""The admission step of a decoder's reservation, the same for both engines.

Once every write of a reservation landed (its immediate's count reached `expected_count`)
and before the reservation moves to ADMITTED, the decoder runs `check_landed`:

1. the count is not above what the reservation expects (`write_overcount`: a page was
   written twice, or something else wrote with the reservation's immediate);
2. where the sender declares how many units it posted (the builtin prefiller's mailbox
   record, its last write, which the count covers), that is exactly what the reservation
   expects (`write_overcount` too). The count alone cannot prove that no write is still to
   come: a push that wrote a page twice reaches `expected_count` with one of its writes
   not counted yet (the extra one, or its mailbox, whose bytes can be in memory before the
   engine counted its completion), and that write lands after admission. The sender's
   total closes it: once the mailbox is read, a declared total above the count means a
   write is missing from the count, so no request is admitted with one in flight;
3. with `kv_integrity` on, the landed pages' CRC-32C equal the prefiller's table, for the
   pairs the setting asks (`checksum_mismatch`; a missing table is `checksums_missing`).

It returns what it checked, and the caller moves the ledger entry to ADMITTED; or it raises
`KVIntegrityError`, and the caller ends the reservation FAILED with the reason `integrity`
and fences it (what landed is not what was meant, so the last write is not known to have
landed). How the table travels and how a page's checksum is computed differ per engine
(the builtin decoder's mailbox and `kv.integrity.verify_pages`; the connector's control
messages and `kv_checksums.LoadChecksums.verify`): each passes its own `verify`. The vLLM
connector's receiver runs it on vLLM's worker thread; the builtin decoder runs the same
step, after its mailbox checks, off its event loop. No threads, no locks of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.kv.integrity import KVIntegrity, KVIntegrityError, Verification


@dataclass(frozen=True)
class LandedCheck:
    """What `check_landed` found in order: (layer, page) pairs checked, seconds verifying."""

    checked: int
    verify_s: float


def check_landed(request_id: str, landed: int, expected: int, mode: KVIntegrity,
                 verify: Callable[[], Verification],
                 clock: Callable[[], float] = time.perf_counter, *, declared: int | None = None) -> LandedCheck:
    """Checks a reservation whose `landed` writes reached its `expected` count (see the
    module docstring); `declared` is the units the sender says it posted (None: its
    protocol carries no such total, the vLLM connector's today); `verify` compares the
    landed pages with the prefiller's table and is called only when `mode` is not OFF.
    Raises `KVIntegrityError` naming `request_id`."""
    if landed < expected:
        raise ValueError(f"request {request_id}: {landed} of {expected} writes landed; admission needs all")
    if landed > expected:
        raise KVIntegrityError(request_id, "write_overcount", f"{landed} writes counted, the reservation expects "
                               f"{expected}: a page was written twice")
    if declared is not None and declared != expected:
        # The count is exact now, yet the sender posted another number: a write of its
        # (an extra page) is not counted yet and would land after admission, or (fewer
        # declared) something else wrote with the reservation's immediate.
        raise KVIntegrityError(request_id, "write_overcount", f"the sender posted {declared} writes, the "
                               f"reservation expects {expected} and {landed} were counted so far: "
                               + ("a page was written twice" if declared > expected
                                  else "a write came from elsewhere"))
    if mode is KVIntegrity.OFF:
        return LandedCheck(0, 0.0)
    started = clock()
    verification = verify()
    verify_s = clock() - started
    if verification.mismatches:
        layer, block, page = verification.mismatches[0]
        raise KVIntegrityError(request_id, "checksum_mismatch", f"{len(verification.mismatches)} of "
                               f"{verification.checked} checked pages differ from the prefiller's CRC-32C; "
                               f"first: layer {layer}, block {block}, page {page}")
    return LandedCheck(verification.checked, verify_s)
