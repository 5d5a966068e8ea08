"""Overload degrades cleanly: 256 and 512 concurrent streams through the router against
real workers whose page pools are far too small for them. Every answer is either correct
(equal to the colocated reference) or a 429 with Retry-After; never a 5xx, never a
timeout of the router's own making. The router exports its event-loop lag meanwhile.

One deployment (etcd, router, 1 prefill + 1 decode, each a pod; the KV crosses the
fabric), tiny model, short outputs, so both bursts together take well under a minute of work.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from support.cluster_load import (
    LONG_PROMPTS,
    SHORT_PROMPTS,
    Reference,
    Result,
    fire,
    get_metrics,
    metric_value,
    wait_pages_free,
)
from support.pod_cluster import client_of, pod_cluster

from kvxfer.cluster.local_cluster import LocalCluster

MAX_TOKENS = 4
#: Prompts of fewer tokens (BOS included) run on the decode worker alone.
MIN_DISAGG_TOKENS = 12
#: Pages per worker: a handful of requests at once (a long prompt + 4 tokens is 3 pages).
NUM_PAGES = 48
STARTUP_S = 120.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def small_pools() -> Iterator[LocalCluster]:
    cluster = pod_cluster(
        prefill=1, decode=1, num_pages=NUM_PAGES, startup_timeout_s=STARTUP_S,
        router_env={
            "KVXFER_ROUTER_DISAGGREGATION_MIN_PROMPT_TOKENS": str(MIN_DISAGG_TOKENS),
            # The default admission limit (256): the 512-stream burst meets the router's own
            # 429s as well as the workers'. The small page pools run out in both bursts.
            "KVXFER_ROUTER_REQUEST_DEADLINE_S": "120",
        },
    )
    print(f"cluster logs: {cluster.log_dir}")
    Reference.warm([(p, MAX_TOKENS) for p in SHORT_PROMPTS + LONG_PROMPTS])
    cluster.start()
    try:
        with client_of(cluster):
            yield cluster
    finally:
        cluster.stop()


def burst(cluster: LocalCluster, streams: int) -> list[Result]:
    prompts = [(SHORT_PROMPTS + LONG_PROMPTS)[i % 20] for i in range(streams)]
    return fire(cluster.router_url, [(p, MAX_TOKENS, i % 2 == 0) for i, p in enumerate(prompts)], timeout_s=150)


@pytest.mark.parametrize("streams", [256, 512])
def test_concurrent_streams_are_correct_or_a_clean_429(small_pools: LocalCluster, streams: int) -> None:
    lag_before = metric_value(get_metrics(small_pools.router_url), "kvxfer_router_event_loop_lag_seconds_count")
    t0 = time.monotonic()
    results = burst(small_pools, streams)
    wall = time.monotonic() - t0

    unclean = [r.describe() + f" retry-after={r.retry_after}" for r in results if not (r.correct() or r.clean_overload)]
    outcomes = Counter("ok" if r.correct() else str(r.status) for r in results)
    assert unclean == [], f"{len(unclean)} of {streams} neither correct nor a clean 429 ({outcomes}, {wall:.1f}s): " \
                          f"{unclean[:5]}"
    # The pools were really too small (some 429s), and requests still got through.
    why = Counter((r.error or "")[:60] for r in results if r.status == 429)
    assert outcomes["ok"] > 0 and outcomes["429"] > 0, (outcomes, why)
    # Full pools came back: nothing leaked by the refused or retried requests.
    wait_pages_free(small_pools, 20)
    text = get_metrics(small_pools.router_url)
    assert metric_value(text, "kvxfer_router_event_loop_lag_seconds_count") > lag_before
    print(f"{streams} streams: {dict(outcomes)} in {wall:.1f}s; event-loop lag sum "
          f"{metric_value(text, 'kvxfer_router_event_loop_lag_seconds_sum'):.2f}s")
