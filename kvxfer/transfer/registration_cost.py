"""Whether registering parts of a region again (`register_windows`, one set per
reservation) is cheap on this provider, and a warning where it is not.

The socket providers (net, tcp) and shm register into a key table: microseconds whatever
the size. RDMA providers (verbs, efa) pin every page of the range at each registration.
The kernel's share alone measured 30-40 ms per GiB with 4 KiB pages, and 0.9 ms with
2 MiB huge pages (benchmarks/bench_registration.py, kernel pin table). So per-reservation
windows are the right default there only when the registered region has huge pages, which
`huge_pages_on_register` asks for. Where the kernel gave none (transparent huge pages set to
never, or memory too fragmented) a decoder pays that pin in every request's TTFT, and its
operator should hear so once, with the other choice (`kv_registration: whole_cache`).
"""

from __future__ import annotations

#: Providers whose fi_mr_reg pins and maps every page of the range (fi_mr(3)).
PINNING_PROVIDERS = frozenset({"verbs", "efa"})
#: Below this share of huge pages a region's windows are registered page by page in effect.
MIN_HUGE_PAGE_FRACTION = 0.5
#: Kernel pin + unpin of 4 KiB pages per GiB, the low end measured here (bench_registration.py).
PIN_MS_PER_GIB_SMALL_PAGES = 30


def huge_page_bytes(address: int, length: int, smaps_path: str = "/proc/self/smaps") -> int:
    """Bytes of this process's mappings that overlap [address, address + length) and are
    backed by huge pages (AnonHugePages, ShmemPmdMapped, FilePmdMapped, Private_Hugetlb
    and Shared_Hugetlb), counted whole per mapping and capped at the overlap."""
    end = address + length
    total = 0
    overlap = 0
    huge = 0
    with open(smaps_path) as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                total += min(huge, overlap)
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlap = max(0, min(hi, end) - max(lo, address))
                huge = 0
            elif overlap and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:",
                                      "Private_Hugetlb:", "Shared_Hugetlb:"):
                huge += int(line.split()[1]) * 1024
    return total + min(huge, overlap)


def per_reservation_pin_warning(provider: str, address: int, length: int) -> str | None:
    """The warning for registering windows of [address, address + length) again per
    reservation on `provider`, or None where that is cheap."""
    if provider not in PINNING_PROVIDERS or length <= 0:
        return None
    fraction = huge_page_bytes(address, length) / length
    if fraction >= MIN_HUGE_PAGE_FRACTION:
        return None
    return (f"provider {provider} pins memory at each registration, and only {fraction:.0%} of the registered "
            f"region ({length / 2**30:.2f} GiB) has huge pages: per-reservation windows will cost about "
            f"{PIN_MS_PER_GIB_SMALL_PAGES} ms per GiB of each request's KV in its TTFT. Enable transparent huge "
            "pages (madvise or always), or set kv_registration: whole_cache (one registration, pinned once; "
            "scope then rests on the NetworkPolicies, the random key and the integrity check)")
