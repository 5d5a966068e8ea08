"""The parts of a decoder's KV cache one reservation lets its prefiller write.

With `kv_registration: per_reservation` the decoder registers these byte ranges again,
with fresh keys, for each reservation (`TransferEngine.register_windows`) and hands out
their descriptor instead of the whole cache's: a holder of it can write the reservation's
prompt pages and nothing else, and only until the reservation stops waiting for its KV.
One window per run of consecutive page ids per layer (the cache is layer-major, so a
request's pages of different layers are never adjacent).
"""

from __future__ import annotations

from kvxfer.kv.layout import layer_offset_bytes

#: Most windows one descriptor carries (the engine's wire format refuses more).
MAX_WINDOWS = 4096


def page_runs(pages: list[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive ids in `pages`, sorted by id."""
    runs: list[tuple[int, int]] = []
    for page in sorted(pages):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def reservation_windows(pages: list[int], num_layers: int, num_pages: int, page_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) in the cache tensor of `pages` in every layer, one per run per layer.

    When the runs would exceed `MAX_WINDOWS` (a very fragmented pool), each layer gets one
    window from its lowest to its highest page: wider than the reservation (it spans pages
    of other requests in between), still revoked with it. Raises ValueError for no pages.
    """
    if not pages:
        raise ValueError("a reservation window needs at least one page")
    runs = page_runs(pages)
    if len(runs) * num_layers > MAX_WINDOWS:
        runs = [(runs[0][0], runs[-1][0] + runs[-1][1] - runs[0][0])]
    windows: list[tuple[int, int]] = []
    for layer in range(num_layers):
        base = layer_offset_bytes(layer, num_pages, page_bytes)
        windows.extend((base + first * page_bytes, count * page_bytes) for first, count in runs)
    return windows
