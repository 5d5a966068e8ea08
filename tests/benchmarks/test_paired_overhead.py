"""The statistics of benchmarks/bench_vllm_connectors.py (benchmarks/paired_overhead.py):
pairing by prompt, goodput under a TTFT bound, and the ratio to the best peer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from paired_overhead import goodput_rps, paired_overhead_s, ratio_to_best_peer  # noqa: E402


def test_overhead_is_the_median_of_per_prompt_differences() -> None:
    # One prompt hit a slow moment (+2.1 s): the difference of medians (3.1 - 2.0 = 1.1 s)
    # follows it, the median of the per-prompt differences (0.1, 0.2, 2.1) stays at 0.2 s.
    colocated = {("a", 0): 1.0, ("a", 1): 2.0, ("a", 2): 3.0}
    config = {("a", 0): 3.1, ("a", 1): 2.1, ("a", 2): 3.2, ("b", 9): 99.0}
    assert paired_overhead_s(config, colocated) == pytest.approx(0.2)
    assert paired_overhead_s({("b", 9): 1.0}, colocated) is None


def test_goodput_counts_requests_within_the_bound_only() -> None:
    assert goodput_rps([0.5, 1.0, 2.5, None], wall_s=2.0, ttft_bound_s=1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        goodput_rps([0.5], wall_s=0.0, ttft_bound_s=1.0)


def test_ratio_to_the_best_peer() -> None:
    assert ratio_to_best_peer(10.0, [40.0, 20.0, None], lower_is_better=True) == pytest.approx(0.5)
    assert ratio_to_best_peer(3.0, [1.0, 2.5], lower_is_better=False) == pytest.approx(1.2)
    assert ratio_to_best_peer(None, [1.0], lower_is_better=True) is None
    assert ratio_to_best_peer(1.0, [-0.5, None], lower_is_better=True) is None
