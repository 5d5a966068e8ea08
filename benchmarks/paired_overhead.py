"""Statistics of `bench_vllm_connectors.py`: the disaggregation overhead paired per prompt,
goodput under a TTFT bound, and the goal ratios of issue 30.

Pairing: a prompt is identified by its key (prompt length, repetition); a configuration's
overhead on that prompt is its TTFT minus the colocated TTFT of the same prompt, and the
figure reported is the median of those differences. Pairing removes the spread between
prompts (and drifts of a shared machine that hit both runs of a prompt alike), which a
difference of two medians keeps.
"""

from __future__ import annotations

import statistics
from typing import Hashable, Mapping, Sequence


def paired_overhead_s(config_ttft: Mapping[Hashable, float], colocated_ttft: Mapping[Hashable, float]) -> float | None:
    """Median over the prompts both measured of (configuration TTFT - colocated TTFT), in
    seconds; None when they share no prompt."""
    diffs = [config_ttft[k] - colocated_ttft[k] for k in config_ttft if k in colocated_ttft]
    return statistics.median(diffs) if diffs else None


def goodput_rps(ttfts_s: Sequence[float | None], wall_s: float, ttft_bound_s: float) -> float:
    """Requests per second that completed with a TTFT within `ttft_bound_s` (a failed request
    is None and never counts), over the batch's wall time."""
    if wall_s <= 0:
        raise ValueError("wall_s must be positive")
    return sum(1 for t in ttfts_s if t is not None and t <= ttft_bound_s) / wall_s


def ratio_to_best_peer(mine: float | None, peers: Sequence[float | None], lower_is_better: bool) -> float | None:
    """kvxfer's figure over the best peer's (lower is better: the smallest peer; else the
    largest); None when either side is missing. A best peer of 0 or less (an overhead the
    noise made negative) gives None: the ratio means nothing there."""
    known = [p for p in peers if p is not None]
    if mine is None or not known:
        return None
    best = min(known) if lower_is_better else max(known)
    return mine / best if best > 0 else None
