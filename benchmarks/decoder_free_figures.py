"""When the decoder freed its blocks after a fault, as bench_vllm_connectors.py's drills
report it: from the block probe's log (benchmarks/probes/sitecustomize.py, written in the
decode instance's EngineCore when its scheduler returns blocks), and beside it the moment
a read of vLLM's `vllm:kv_cache_usage_perc` gauge first showed 0, which lags the free by
the API server's stats interval and by the read itself (a /metrics page of tens of KB).
"""

from __future__ import annotations

from typing import Any


def scheduler_free_after(log_text: str | None, since: float, deadline_s: float) -> dict[str, Any]:
    """{"free_s": seconds from `since` (CLOCK_MONOTONIC, as the probe stamps) until the
    scheduler's block pool was back at its idle free count by returning blocks, or None;
    "reason": why None}. Idle means every pool the probe saw is at its idle free count,
    and the record counts only if that call returned blocks (its own free count before
    and after): a call that freed nothing is not the request's blocks coming back."""
    if log_text is None or not any(ln.startswith("patched ") for ln in log_text.splitlines()):
        return {"free_s": None, "reason": "probe not loaded in the decoder's EngineCore"}
    records = []
    for ln in log_text.splitlines():
        parts = ln.split()
        if len(parts) == 7 and parts[0] == "free":
            records.append((float(parts[1]), (parts[2], parts[3]), int(parts[4]), int(parts[5]), int(parts[6])))
    if not records:
        # Patched in a process that never frees (the API server imports the pool module
        # too): the EngineCore, which frees after every request, did not load it.
        return {"free_s": None, "reason": "probe recorded no free: not loaded in the decoder's EngineCore"}
    records.sort(key=lambda r: r[0])
    free_of: dict[tuple[str, str], tuple[int, int]] = {}
    after = 0
    for t, pool, before, free, idle in records:
        free_of[pool] = (free, idle)
        if t < since:
            continue
        after += 1
        if free > before and all(f == i for f, i in free_of.values()):
            if t - since > deadline_s:
                break
            return {"free_s": t - since, "reason": None}
    return {"free_s": None, "reason": f"pool not back at idle within {deadline_s:g} s "
                                      f"({after} frees recorded after the fault)"}


def free_cell(figure: float | None, reason: str | None, spec: str = ".3f") -> str:
    """A table cell for a free time: the seconds, or '-' with the reason (never a number
    the probe did not record)."""
    if figure is not None:
        return format(figure, spec)
    return f"- ({reason})" if reason else "-"


def gauge_cell(zero_s: float | None, read_gap_ms: float | None, deadline_s: float) -> str:
    """A table cell for the gauge read: seconds until a read showed 0, with the gap to the
    read before it (its resolution), or '> deadline'."""
    if zero_s is None:
        return f"> {deadline_s:g}"
    gap = "-" if read_gap_ms is None else f"{read_gap_ms:.0f}"
    return f"{zero_s:.3f} (gap {gap} ms)"


def ratio_line(config: str, what: str, mine: float | None, peers: list[float | None], deadline_s: float) -> str | None:
    """The kill goal's verdict line for one measure (`what`): mine over the best peer's,
    a peer that never freed counting as the deadline (a lower bound); None without figures."""
    if mine is None or not peers:
        return None
    bounds = [t if t is not None else deadline_s for t in peers]
    best = min(bounds)
    ratio = mine / best if best > 0 else None
    verdict = "n/a" if ratio is None else ("met" if ratio < 0.1 else "NOT met")
    shown = "-" if ratio is None else f"{ratio:.3f}"
    return (f"{config}: decoder blocks free ({what}) {mine:.3f} s after a killed prefiller vs best peer "
            f"{best:.3f} s: {shown}x (goal < 0.1x) -> {verdict}")
