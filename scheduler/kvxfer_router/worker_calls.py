"""The router's calls to kvxfer's own workers: JSON POSTs, NDJSON streams and cancels, over
one httpx client, each bounded by its deadline and failing as :class:`LegFailure`.

The builtin leg type (``builtin_legs``) runs a request with them, its clean-up included.
Cancels run as tracked background tasks, so that a client's answer never waits for one and
shutdown can wait for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from .directory import WorkerView
from .leg_failure import LegFailure, short_detail
from .settings import RouterSettings
from .worker_auth import WorkerCallSigner

log = logging.getLogger(__name__)

# Statuses with which a worker refuses the request's own content (prompt too long for the
# model's context, max_tokens out of range...) on the calls that carry it: decode POST
# /reserve and POST /generate_local. Every worker would answer the same, so such a refusal
# is the client's 400, never retried; other 4xx (409, 429), 5xx and connection errors are
# the worker's trouble and go to another pair.
REQUEST_REJECTED_STATUSES = (400, 422)
# A stream's last line is followed only by the end of the chunked body, at once; a worker
# that sends more than this many lines after it, or keeps the stream open longer than this
# (seconds, per line), is not waited for: the connection is closed instead of reused.
_LINES_AFTER_LAST_READ = 8
_REST_OF_STREAM_WAIT_S = 0.5


def client_failure(exc: Exception, request_id: str, worker: WorkerView, stage: str, path: str) -> LegFailure:
    """A leg failure for an exception from the HTTP client that is none of its own errors.

    Seen: httpcore's pool, checking whether an idle connection to a worker that had just
    been SIGKILLed was readable, asked anyio for the socket of a transport already closed
    and raised AttributeError ('NoneType' object has no attribute 'getpeername'). That is
    the worker's connection failing, not the request: the leg fails and the request goes to
    another pair, where an escaped exception answered the client 500. Logged with its
    traceback, since it is a library's bug or ours."""
    log.warning("request %s: POST %s to %s: the HTTP client raised %r", request_id, path, worker.worker_id, exc,
                exc_info=exc)
    return LegFailure(request_id, worker, stage, f"POST {path}: the HTTP client failed on this worker's connection: "
                      f"{type(exc).__name__}: {exc}")


class WorkerCalls:
    """Calls to kvxfer workers over ``client``, signed by ``signer``, bounded by ``settings``;
    owns the background tasks of the cancels it sends. One per router app."""

    def __init__(self, settings: RouterSettings, client: httpx.AsyncClient, signer: WorkerCallSigner) -> None:
        self.settings = settings
        self.client = client
        self.signer = signer
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a tracked background task (kept referenced until it ends)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def pending(self) -> list[asyncio.Task[Any]]:
        """Background tasks that have not ended."""
        return list(self._background)

    async def post_json(
        self, worker: WorkerView, path: str, body: dict[str, Any], *, stage: str, request_id: str, total_timeout_s: float
    ) -> dict[str, Any]:
        """POST ``body`` to ``worker``; the JSON object it answers, or :class:`LegFailure`.

        Bounded twice: httpx's per-operation timeouts and ``total_timeout_s`` for the whole
        call, because a worker trickling bytes would otherwise reset the read timeout.
        """
        timeout = httpx.Timeout(total_timeout_s, connect=self.settings.connect_timeout_s)
        try:
            resp = await asyncio.wait_for(
                self.client.post(timeout=timeout, **self.signer.request(worker, path, body)),
                total_timeout_s
            )
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            # Say which limit hit: a connect timeout is not the whole call's.
            limit = (f"connecting took over {self.settings.connect_timeout_s}s" if isinstance(exc, httpx.ConnectTimeout)
                     else f"after {total_timeout_s}s")
            raise LegFailure(request_id, worker, stage, f"POST {path} timed out ({limit})", timed_out=True,
                             never_sent=isinstance(exc, httpx.ConnectTimeout)) from None
        except httpx.ConnectError as exc:  # refused or unroutable: not one byte of the call went out
            raise LegFailure(request_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}",
                             never_sent=True) from exc
        except httpx.HTTPError as exc:
            raise LegFailure(request_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # the client's own failure on the connection (client_failure)
            raise client_failure(exc, request_id, worker, stage, path) from exc
        if resp.status_code >= 400:
            raise LegFailure.from_answer(request_id, worker, stage, path, resp.status_code, resp.text, resp.headers,
                                         rejected=path == "/reserve" and resp.status_code in REQUEST_REJECTED_STATUSES)
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise LegFailure(request_id, worker, stage,
                             f"POST {path} answered a non-object body: {short_detail(resp.text)}")
        return data

    async def stream_lines(
        self, worker: WorkerView, path: str, body: dict[str, Any], *, stage: str, request_id: str,
        rejected_statuses: tuple[int, ...], end_marker: str, is_last: Callable[[str], bool],
    ) -> AsyncIterator[str]:
        """The lines of a streamed POST to ``worker``, each within its deadline, or :class:`LegFailure`.

        The first line may take ``first_token_timeout_s`` (prefill and admission come first),
        every later one ``token_idle_timeout_s``. A status of 400 or more fails the leg, as a
        client error when it is in ``rejected_statuses``; so does a stream that ends before
        the caller stopped reading at ``end_marker`` (its protocol's last line, which
        ``is_last`` recognises). Use it with ``contextlib.aclosing``, so that an early return
        closes the connection.

        The line ``is_last`` recognises is yielded only once the rest of the body is read,
        so that the connection goes back to the client's pool when the caller stops there.
        A stream left unfinished makes httpx close its connection: every request opened a
        new one to its decoder, and the router's side of each waited a minute in TIME-WAIT
        (1,500 sockets at 25 requests/s; about 470 requests/s to one worker would use up
        the ephemeral ports).
        """
        s = self.settings
        timeout = httpx.Timeout(s.first_token_timeout_s, connect=s.connect_timeout_s, write=s.control_timeout_s)
        try:
            async with self.client.stream("POST", timeout=timeout, **self.signer.request(worker, path, body)) as resp:
                if resp.status_code >= 400:
                    text = (await asyncio.wait_for(resp.aread(), s.control_timeout_s)).decode(errors="replace")
                    raise LegFailure.from_answer(request_id, worker, stage, path, resp.status_code, text, resp.headers,
                                                 rejected=resp.status_code in rejected_statuses)
                async with contextlib.aclosing(timed_lines(resp, s, request_id, worker, stage, end_marker,
                                                           is_last)) as lines:
                    async for line in lines:
                        yield line
        except (httpx.TimeoutException, asyncio.TimeoutError) as exc:
            raise LegFailure(request_id, worker, stage, f"POST {path} timed out: {type(exc).__name__}",
                             timed_out=True) from exc
        except httpx.HTTPError as exc:
            raise LegFailure(request_id, worker, stage, f"POST {path}: {type(exc).__name__}: {exc}") from exc
        except LegFailure:
            raise
        except Exception as exc:  # the client's own failure on the connection (client_failure)
            raise client_failure(exc, request_id, worker, stage, path) from exc

    async def cancel_legs(self, request_id: str, workers: list[WorkerView], *,
                          prefill_never_sent: bool = False) -> None:
        """``POST /cancel`` to each of ``workers`` concurrently; failures are logged only,
        since clean-up must never turn into a second error for the client.

        A prefiller answers ``in_flight: false`` only once none of its writes for the
        request can land (and it refuses the id from then on): the decoder is told so
        (``prefill_stopped``) and reuses the pages at once instead of at its fence deadline.
        ``prefill_never_sent``: the connection for ``/prefill`` was never made, so the
        prefiller never had the reservation and nothing of it can land; the decoder is told
        so at once. (A dead prefiller refuses connections: without this every request sent
        its way until its lease expires would hold its pages for the whole fence.)
        """
        if prefill_never_sent:
            await asyncio.gather(*(self._cancel_one(request_id, w, {"request_id": request_id, "prefill_stopped": True})
                                   for w in workers if w.role == "decode"))
            return

        replies = await asyncio.gather(*(self._cancel_one(request_id, w, {"request_id": request_id}) for w in workers))
        stopped = any(w.role == "prefill" and r is not None and r.get("in_flight") is False
                      for w, r in zip(workers, replies))
        if stopped:
            await asyncio.gather(*(self._cancel_one(request_id, w, {"request_id": request_id, "prefill_stopped": True})
                                   for w in workers if w.role == "decode"))

    async def _cancel_one(self, request_id: str, worker: WorkerView, body: dict[str, Any],
                          attempt: int = 0) -> dict[str, Any] | None:
        try:
            return await self.post_json(
                worker, "/cancel", body, stage="cancel",
                request_id=request_id, total_timeout_s=self.settings.cancel_timeout_s,
            )
        except LegFailure as exc:
            log.warning("cancel not confirmed: %s", exc)
            if exc.status is None and attempt < self.settings.cancel_retries:
                # No answer (a starved or restarting worker): the reservation may still be
                # held, and only a cancel frees it before reservation_ttl_s. Sent again in
                # the background, so the client's answer does not wait for it.
                self.spawn(self._cancel_later(request_id, worker, body, attempt + 1))
            return None

    async def _cancel_later(self, request_id: str, worker: WorkerView, body: dict[str, Any], attempt: int) -> None:
        await asyncio.sleep(self.settings.cancel_timeout_s * attempt)
        await self._cancel_one(request_id, worker, body, attempt)

    async def cancel_shielded(self, request_id: str, workers: list[WorkerView], *,
                              prefill_never_sent: bool = False) -> None:
        """:meth:`cancel_legs` in a background task, awaited through shield: a second cancel
        of the caller (shutdown racing a disconnect) must not cut the cancels short and leak
        decode pages. That cancel still propagates to the caller, so a cancelled request
        never goes on to a retry."""
        await asyncio.shield(self.spawn(self.cancel_legs(request_id, workers, prefill_never_sent=prefill_never_sent)))


async def timed_lines(resp: httpx.Response, settings: RouterSettings, request_id: str, worker: WorkerView, stage: str,
                      end_marker: str, is_last: Callable[[str], bool]) -> AsyncIterator[str]:
    """The lines of a streamed answer, each within its deadline (the first
    ``first_token_timeout_s``, later ones ``token_idle_timeout_s``), or :class:`LegFailure`;
    so is a stream that ends before the caller stopped reading at ``end_marker``. The line
    ``is_last`` recognises is yielded only once the rest of the body is read, so that the
    connection goes back to the client's pool (see :meth:`WorkerCalls.stream_lines`)."""
    lines = resp.aiter_lines()
    wait_s = settings.first_token_timeout_s
    while True:
        try:
            line = await asyncio.wait_for(lines.__anext__(), wait_s)
        except StopAsyncIteration:
            raise LegFailure(request_id, worker, stage, f"stream ended before {end_marker}") from None
        except asyncio.TimeoutError:
            raise LegFailure(request_id, worker, stage, f"no stream line within {wait_s}s", timed_out=True) from None
        wait_s = settings.token_idle_timeout_s
        if is_last(line):
            await _read_to_end(lines, _REST_OF_STREAM_WAIT_S)
        yield line


async def _read_to_end(lines: AsyncIterator[str], timeout_s: float) -> None:
    """Reads what follows a stream's last line (normally nothing but the end of the body),
    at most _LINES_AFTER_LAST_READ lines, each within ``timeout_s``; gives up silently (the
    connection is then closed rather than reused)."""
    with contextlib.suppress(StopAsyncIteration, asyncio.TimeoutError):
        for _ in range(_LINES_AFTER_LAST_READ):
            await asyncio.wait_for(lines.__anext__(), timeout_s)


def is_done_line(line: str) -> bool:
    """Whether an NDJSON line of a decode worker's stream is its last (``"done": true``);
    a line that does not parse is not (the reader reports it)."""
    if '"done"' not in line:  # every token line is parsed once more otherwise
        return False
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and bool(obj.get("done"))


def stream_object(text: str, wrid: str, decode: WorkerView, stage: str, what: str) -> dict[str, Any]:
    """One JSON object of a decode stream (an NDJSON line or an SSE event's data); anything
    else fails the leg with LegFailure naming `what` it was."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise LegFailure(wrid, decode, stage, f"unreadable {what} {short_detail(text)!r}") from None
    if not isinstance(obj, dict):
        raise LegFailure(wrid, decode, stage, f"unexpected {what} {short_detail(text)!r}")
    return obj


__all__ = ["REQUEST_REJECTED_STATUSES", "WorkerCalls", "is_done_line", "stream_object", "timed_lines"]
