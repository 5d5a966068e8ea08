"""The two legs of a disaggregated request, as one interface with a type per engine kind.

A *leg type* (:class:`RequestLegs`) runs one attempt of a request on a chosen pair: the
prefill leg and the decode leg, or the decode leg alone when the pair has no prefill
worker. ``builtin_legs`` speaks kvxfer's own worker API (the router relays the decoder's
reservation to the prefiller); ``vllm_legs`` speaks vLLM's OpenAI API (the decode instance
sends its reservation to the prefill instance itself). Which one serves a pair follows from
the pair's registry ``engine``, in one mapping (``engine_legs``).

A leg type drives the request only through :class:`LegRequest`, the lifecycle's public
face (its job, its state, and where the output goes), and calls workers through the
router-wide :class:`LegServices`; it fails an attempt with ``LegFailure`` (another pair may
serve it) or ``RouterError`` (the client's answer).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from .policies import WorkerPair
from .settings import RouterSettings
from .telemetry import RouterTelemetry
from .load_report_fetch import LoadReportFetcher
from .vllm_http import VllmLegClient
from .worker_auth import WorkerCallSigner
from .worker_calls import WorkerCalls

log = logging.getLogger(__name__)


class RequestState(enum.Enum):
    """Where a request is in its lifecycle."""

    ADMITTED = "admitted"
    RESERVING = "reserving"          # decode POST /reserve in flight
    TRANSFERRING = "transferring"    # prefill and decode legs both running, no token yet
    GENERATING = "generating"        # short prompt on decode alone, no token yet
    STREAMING = "streaming"          # tokens are reaching the client: no retry any more
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class CompletionJob:
    """What the router was asked to do, already validated and tokenized."""

    request_id: str
    model: str
    prompt_tokens: list[int]
    max_tokens: int
    needs_prefill: bool
    #: "completion" or "chat": which OpenAI endpoint the client called.
    kind: str = "completion"
    #: The client's body, for leg types that relay it (vLLM: it tokenizes and templates it
    #: itself); None for kvxfer's own workers, which get `prompt_tokens`.
    body: dict[str, Any] | None = None


class LegRequest(Protocol):
    """What a leg type sees of one request's lifecycle (``dispatch.RequestLifecycle``)."""

    job: CompletionJob
    state: RequestState

    @property
    def request_id(self) -> str:
        """The client-facing request id."""

    def token(self, token: int, text: str) -> None:
        """One generated token, for the client (held until the finish when not streamed)."""

    def finish(self, finish_reason: str, reported_usage: Any, text: str) -> None:
        """The generation ended normally. ``reported_usage`` is the decoder's usage object
        (counted by the lifecycle when it is not well-formed); ``text`` is what the
        decoder's last line still carried."""

    def relay(self, event: Any, *, last: bool) -> None:
        """A piece of a worker's own answer for the client as it is; ``last`` ends the request."""


@dataclass(frozen=True)
class LegServices:
    """What every leg type may use, one set per router app: the settings, the telemetry, the
    signer of worker calls, kvxfer workers' calls (httpx), vLLM instances' client (aiohttp)
    and the fetcher of streamed requests' load figures from vLLM decode instances (None: none)."""

    settings: RouterSettings
    telemetry: RouterTelemetry
    signer: WorkerCallSigner
    worker_calls: WorkerCalls
    vllm_http: VllmLegClient
    load_reports: LoadReportFetcher | None = None


class RequestLegs(abc.ABC):
    """The legs of one request on one engine kind; stateless, one instance serves every request.

    ``relays_client_body``: the client's JSON body goes to the workers as it is (they
    validate, tokenize and answer in their own schema) instead of through the router's own
    schema and tokenizer. ``reports_prefix_index``: the workers answer ``POST
    /prefix_index`` with what their prefix cache holds (``kv_index.PrefixIndexPoller``).
    """

    relays_client_body: bool = False
    reports_prefix_index: bool = False

    @abc.abstractmethod
    async def run(self, request: LegRequest, services: LegServices, pair: WorkerPair, attempt_id: str) -> None:
        """Run one attempt of ``request`` on ``pair`` under the workers' id ``attempt_id``,
        handing the client its output through ``request``; returns once the answer is whole.
        Raises ``LegFailure`` (retried on another pair before the first byte) or ``RouterError``
        (the client's answer). Cancelling it stops both legs and frees what they held."""


async def wait_for_legs(request: LegRequest, prefill_leg: asyncio.Future[Any], decode_leg: asyncio.Future[Any]) -> None:
    """Wait until the decode leg ended, or the prefill leg failed before the decoder's output began.

    A decoder's output begins only once it admitted the request: every write of the prompt's
    KV landed (and was checked). From then on the prefill leg's own reply cannot change the
    client's answer, so a prefill leg that fails after that (its worker died before it
    replied) is logged and the decode leg goes on; cutting a correct stream for it would
    fail a request that was already served. A prefill failure before the output began is
    the caller's to raise (the attempt fails and may be retried on another pair)."""
    await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_EXCEPTION)
    if not decode_leg.done() and request.state is RequestState.STREAMING:
        await asyncio.wait({decode_leg})
    if decode_leg.done() and not decode_leg.cancelled() and decode_leg.exception() is None \
            and prefill_leg.done() and not prefill_leg.cancelled() and prefill_leg.exception() is not None:
        log.warning("request %s: the prefill leg failed after the decoder had the KV; its answer stands: %s",
                    request.request_id, prefill_leg.exception())


__all__ = ["CompletionJob", "LegRequest", "LegServices", "RequestLegs", "RequestState", "wait_for_legs"]
