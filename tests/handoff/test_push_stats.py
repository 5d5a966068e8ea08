"""PushStats.wire_s: the seconds a request's KV writes were in flight, whatever their overlap."""

from __future__ import annotations

import pytest

from kvxfer.handoff.push_session import _covered_seconds


@pytest.mark.parametrize(
    ("spans", "covered"),
    [
        ([], 0.0),
        ([(1.0, 2.0)], 1.0),
        ([(1.0, 2.0), (3.0, 3.5)], 1.5),  # layers apart: the compute between is not counted
        ([(1.0, 3.0), (2.0, 4.0)], 3.0),  # K and V of a layer in flight together
        ([(2.0, 4.0), (1.0, 5.0), (4.5, 6.0)], 5.0),  # one span inside another, any order
        ([(1.0, 2.0), (2.0, 3.0)], 2.0),  # back to back
    ],
)
def test_covered_seconds_is_the_length_of_the_union_of_spans(
    spans: list[tuple[float, float]], covered: float
) -> None:
    assert _covered_seconds(spans) == pytest.approx(covered)
