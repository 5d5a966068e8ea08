"""The load figures of a streamed request on vLLM instances, asked for once its stream ended.

vLLM's OpenAI server sends the connector's `kv_transfer_params` (where a decode instance
reports the KV its load moved) only in non-streamed answers, so for a streamed request the
router asks the decode instance afterwards: ``GET <metrics_url>/kvxfer/loads/<transfer_id>``
on the instance's connector HTTP server (`kvxfer.integrations.vllm.load_reports`; its
registry record's `metrics_url`, absent from older instances, which then report nothing
for streamed requests), with the cluster's vLLM API key. The call starts only after the
client got ``data: [DONE]``, in a task of its own: it never delays an answer. It has one
deadline (``load_report_timeout_s``) and no retry; a failure is logged at debug level and
counted (``kvxfer_router_load_report_fetch_failures_total``), and at most
``MAX_FETCHES_IN_FLIGHT`` run at once (more are counted ``busy`` and not sent), so a slow
instance under a burst of streams never piles up calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from .directory import WorkerView
from .settings import RouterSettings
from .telemetry import RouterTelemetry
from .vllm_http import VllmLegClient
from .worker_auth import WorkerCallSigner

log = logging.getLogger(__name__)

#: Fetches running at once, all instances together: each is one small GET that ends within
#: load_report_timeout_s, so this bounds them well above what streams end per deadline.
MAX_FETCHES_IN_FLIGHT = 256
#: The most of a report's body read (a report is under 200 bytes).
MAX_REPORT_BYTES = 4096


class LoadReportFetcher:
    """Asks decode instances for the load figures of streamed requests and hands each to
    ``telemetry.decode_load_report``; one per router app, closed with it."""

    def __init__(self, settings: RouterSettings, telemetry: RouterTelemetry, signer: WorkerCallSigner,
                 vllm_http: VllmLegClient) -> None:
        self._timeout_s = settings.load_report_timeout_s
        self._telemetry = telemetry
        self._signer = signer
        self._vllm_http = vllm_http
        self._tasks: set[asyncio.Task[None]] = set()

    def after_stream(self, decode: WorkerView, transfer_id: str) -> None:
        """The stream of transfer ``transfer_id`` on ``decode`` ended: fetch its figures in
        the background (nothing where the instance's record names no ``metrics_url``)."""
        if not decode.metrics_url:
            return
        if len(self._tasks) >= MAX_FETCHES_IN_FLIGHT:
            self._telemetry.load_report_fetch_failed("busy")
            return
        task = asyncio.get_running_loop().create_task(self._fetch(decode, transfer_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, decode: WorkerView, transfer_id: str) -> None:
        url = f"{decode.metrics_url.rstrip('/')}/kvxfer/loads/{transfer_id}"
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._vllm_http.session().get(url, headers=self._signer.vllm_headers()) as resp:
                    if resp.status != 200:
                        self._failed("refused", decode, transfer_id, f"HTTP {resp.status}")
                        return
                    raw = await resp.content.read(MAX_REPORT_BYTES)
        except asyncio.TimeoutError:
            self._failed("timeout", decode, transfer_id, f"no answer within {self._timeout_s}s")
            return
        except aiohttp.ClientError as exc:
            self._failed("unreachable", decode, transfer_id, f"{type(exc).__name__}: {exc}")
            return
        report = _report_of(raw)
        if report is None:
            self._failed("malformed", decode, transfer_id, repr(raw[:200]))
            return
        self._telemetry.decode_load_report(report)

    def _failed(self, reason: str, decode: WorkerView, transfer_id: str, detail: str) -> None:
        log.debug("no load figures for transfer %s from %s (%s): %s", transfer_id, decode.worker_id, reason, detail)
        self._telemetry.load_report_fetch_failed(reason)

    @property
    def in_flight(self) -> int:
        """Fetches running now."""
        return len(self._tasks)

    async def aclose(self) -> None:
        """Cancel the fetches still running (their figures are lost, as on any shutdown)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _report_of(raw: bytes) -> dict[str, Any] | None:
    """The decode report in an answer shaped as the connector's ``kv_transfer_params``, or None."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    report = parsed.get("kvxfer") if isinstance(parsed, dict) else None
    if not isinstance(report, dict) or report.get("role") != "decode":
        return None
    return report


__all__ = ["MAX_FETCHES_IN_FLIGHT", "LoadReportFetcher"]
