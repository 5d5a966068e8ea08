"""The router takes a vLLM decode instance's report of the KV it loaded out of a
non-streamed answer (`kv_transfer_params`, put there by the connector) for its metrics;
the client gets null there, as from plain vLLM, and every other byte as vLLM wrote it."""

from __future__ import annotations

import json

from kvxfer_router.telemetry import RouterTelemetry
from kvxfer_router.vllm_legs import _take_load_report
from prometheus_client import CollectorRegistry

from kvxfer.metrics import RouterMetrics

REPORT = {"role": "decode", "pages_loaded": 8, "bytes_loaded": 131072, "pages_held": 4}
# vLLM's own bytes: a float formatted its way and generated text that quotes the field name.
ANSWER = ('{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"say \\"kv_transfer_params\\": '
          '{}","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":70,"total_tokens":74,'
          '"completion_tokens":4},"kv_transfer_params":' + json.dumps({"kvxfer": REPORT}) + ',"x":1.10}')


def test_the_report_is_taken_and_the_client_sees_null_and_vllms_other_bytes() -> None:
    report, text = _take_load_report(json.loads(ANSWER), ANSWER)
    assert report == REPORT
    assert text == ANSWER.replace(json.dumps({"kvxfer": REPORT}), "null")


def test_an_answer_without_a_decode_report_is_left_as_it_is() -> None:
    plain = ANSWER.replace(json.dumps({"kvxfer": REPORT}), "null")
    assert _take_load_report(json.loads(plain), plain) == (None, plain)


def test_the_report_feeds_the_routers_kv_moved_metrics() -> None:
    registry = CollectorRegistry()
    RouterTelemetry(RouterMetrics(registry)).decode_load_report(REPORT)
    assert registry.get_sample_value("kvxfer_router_request_kv_moved_bytes_sum") == 131072
    assert registry.get_sample_value("kvxfer_router_kv_pages_moved_total") == 8
    assert registry.get_sample_value("kvxfer_router_kv_pages_not_sent_total") == 4
