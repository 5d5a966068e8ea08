"""Every metric kvxfer exports is written by some code path, and failure reasons are the
label values the dashboard and alerts select on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvxfer.errors import TransferError, TransferTimeout
from kvxfer.metrics import TRANSFER_FAILURE_REASONS, PrefillMetrics
from kvxfer.workers.prefill.service import transfer_failure_reason

REPO = Path(__file__).resolve().parents[2]
METRICS = REPO / "kvxfer" / "metrics.py"


def test_every_metric_attribute_is_written_outside_its_definition() -> None:
    # A metric defined but never set still exports 0, so a dashboard panel on it looks
    # alive while it measures nothing (kvxfer_router_requests_queued had one).
    source = METRICS.read_text()
    attrs = re.findall(r"self\.(\w+) = (?:Counter|Gauge|Histogram)\(", source)
    assert attrs
    code = "\n".join(p.read_text() for root in ("kvxfer", "scheduler") for p in (REPO / root).rglob("*.py")
                     if p != METRICS)
    never_written = [a for a in attrs
                     if not re.search(rf"\.{a}\b", code) and len(re.findall(rf"self\.{a}\b", source)) < 2]
    assert not never_written, f"metrics nobody writes: {never_written}"


@pytest.mark.parametrize(("exc", "cancelled", "reason"), [
    (TransferTimeout("r1", "write did not complete within 10 s"), False, "timeout"),
    (TransferError("r1", "cannot resolve peer address"), False, "peer_unreachable"),
    (TransferError("r1", "completion error: Input/output error"), False, "completion_error"),
    (TransferError("r1", "write failed"), True, "cancelled"),
])
def test_a_failed_push_counts_under_a_known_reason(exc: Exception, cancelled: bool, reason: str) -> None:
    registry = CollectorRegistry()
    metrics = PrefillMetrics(registry)
    metrics.count_transfer_failure(transfer_failure_reason(exc, cancelled))
    text = generate_latest(registry).decode()
    assert f'kvxfer_prefill_kv_transfer_failures_total{{reason="{reason}"}} 1.0' in text, text


def test_an_unknown_failure_reason_is_refused_not_exported() -> None:
    # Before: the label was the exception's class name ("TransferTimeout"), a series no
    # panel or alert selects, while the known series stayed at 0.
    metrics = PrefillMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="unknown transfer failure reason"):
        metrics.count_transfer_failure("TransferTimeout")
    assert set(TRANSFER_FAILURE_REASONS) >= {"timeout", "cancelled", "peer_unreachable", "completion_error"}


def test_prometheus_runner_imports_without_pyyaml() -> None:
    # PyYAML is a test dependency only; the image has none. The config is written as JSON.
    code = (
        "import sys, json, tempfile, pathlib; sys.modules['yaml'] = None\n"
        "from kvxfer.cluster.prometheus_runner import PrometheusRunner\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
