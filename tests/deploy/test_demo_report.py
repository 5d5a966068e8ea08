"""The demo's table (kvxfer.cluster.demo): figures from what the client saw and the workers'
metrics, without starting a cluster."""

from __future__ import annotations

import math

from kvxfer.cluster.demo import Turn, _histogram_quantile, _report

PAGE_BYTES = 8192


def _turn(turn: int, stamps: list[float]) -> Turn:
    return Turn(user=0, turn=turn, ok=True, ttft_s=stamps[0], stamps=stamps,
                serving_mode="disaggregated")


def test_inter_token_latency_is_each_requests_mean_gap_when_tokens_arrive_together() -> None:
    # Five tokens in two reads: three share one stamp, two the next. Per-gap figures would
    # be mostly 0.0; the mean gap is what the stream took per token.
    t = _turn(0, [0.100, 0.100, 0.100, 0.120, 0.120])
    assert t.inter_token_s is not None
    assert math.isclose(t.inter_token_s, 0.005)
    assert _turn(0, [0.1]).inter_token_s is None


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    metrics = {"m_bucket|0.01": 2.0, "m_bucket|0.1": 10.0, "m_bucket|inf": 10.0}
    assert math.isclose(_histogram_quantile(metrics, "m", 0.5), 0.01 + 0.09 * 3 / 8)
    assert math.isnan(_histogram_quantile({}, "m", 0.5))


def test_table_shows_hits_on_each_side_pages_not_pushed_and_kv_per_request() -> None:
    results = [_turn(0, [0.2, 0.21, 0.22]), _turn(1, [0.05, 0.06, 0.07])]
    prefill = {"kvxfer_prefill_prefix_hit_tokens_total": 50.0, "kvxfer_prefill_prefix_lookup_tokens_total": 200.0,
               "kvxfer_prefill_kv_pages_skipped_total": 6.0,
               "kvxfer_prefill_kv_pushed_bytes_total": 4.0 * PAGE_BYTES,
               "kvxfer_prefill_kv_transfer_seconds_count": 2.0,
               "kvxfer_prefill_kv_transfer_seconds_bucket|0.005": 1.0,
               "kvxfer_prefill_kv_transfer_seconds_bucket|0.01": 2.0,
               "kvxfer_prefill_kv_transfer_seconds_bucket|inf": 2.0}
    decode = {"kvxfer_decode_prefix_hit_tokens_total": 100.0, "kvxfer_decode_prefix_lookup_tokens_total": 200.0}
    rows = dict(_report(results, 1.0, prefill, decode, PAGE_BYTES))
    assert rows["requests ok / sent"] == "2 / 2"
    assert rows["TTFT p50 / p99, first turns (ms)"] == "200.0 / 200.0"
    assert rows["TTFT p50 / p99, later turns (ms)"] == "50.0 / 50.0"
    assert rows["inter-token p50 / p99 (ms, each request's mean gap)"] == "10.00 / 10.00"
    assert rows["prompt tokens found in the prefill worker's cache"] == "50 of 200 (25%)"
    assert rows["prompt tokens the decode workers already held"] == "100 of 200 (50%)"
    assert rows["KV pages pushed / not pushed (decoder held them)"] == "4 / 6"
    assert rows["KV pushed per request (mean)"] == "16.0 KiB in 2 pushes"
    assert rows["KV push p50 / p99 (ms, first write posted to last landed)"] == "5.0 / 9.9"


def test_table_says_when_the_workers_report_no_prefix_cache() -> None:
    rows = dict(_report([_turn(0, [0.2, 0.3])], 1.0, {}, {}, PAGE_BYTES))
    assert rows["prompt tokens found in the prefill worker's cache"] == "not reported by the workers"
    assert rows["KV pages pushed / not pushed (decoder held them)"] == "0 / not reported by the workers"
    assert rows["KV pushed per request (mean)"] == "no push"
