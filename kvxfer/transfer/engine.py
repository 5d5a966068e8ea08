"""Python face of the native WriteImm engine (kvxfer._native).

`TransferEngine` owns one native engine: a progress thread that owns the libfabric
domains of all rails. Calls here validate arguments, turn buffers into (address, length)
and release the GIL inside the extension, so Python threads and asyncio tasks can submit
while transfers run. Asyncio integration uses the engine's event fd: one reader per event
loop, no thread per waiting transfer.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Sequence

import numpy as np

from kvxfer.errors import BoundsError, EngineError, ImmCounterOverflow, TransferError, TransferTimeout
from kvxfer.transfer.native_library import native as _native
from kvxfer.transfer.registration_cost import per_reservation_pin_warning
from kvxfer.transfer.remote_cache import RemoteDescriptorCache
from kvxfer.transfer.shared_memory import shared_buffer_of

log = logging.getLogger("kvxfer.transfer")

# Native status codes (TransferStatus in engine_types.hpp).
_PENDING, _DONE, _FAILED, _TIMED_OUT = 0, 1, 2, 3
# Native event kinds (EventKind in progress_worker.hpp).
_EVENT_TRANSFER, _EVENT_IMM = 1, 2

PageList = Sequence[int] | np.ndarray | Any

# Spellings KVXFER_SAME_HOST and KVXFER_SAME_HOST_IMM_RING accept (case-insensitive), as
# pydantic reads booleans for the workers' settings, so a variable means the same to a
# worker and to a bare engine.
_ENV_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_ENV_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})


def _switch_from_env(name: str) -> bool:
    """An on/off environment variable as a bool: on when unset or empty; anything unknown is
    an error rather than a silent default, since a typo would otherwise leave it on."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw or raw in _ENV_TRUE:
        return True
    if raw in _ENV_FALSE:
        return False
    raise EngineError(f"{name}={os.environ[name]!r}: expected true/false (1/0, yes/no, on/off)")


#: The congestion control kvxfer's fabric connections use unless told otherwise, in order of
#: preference (see TransferEngine's tcp_congestion): reno where the kernel refuses cubic to
#: an unprivileged process, whose tcp_allowed_congestion_control is by default reno and the
#: system's default only.
DEFAULT_TCP_CONGESTION = "cubic,reno"
#: Same-host writers pinned at once (a pidfd each): one per prefill engine a decoder loads
#: from, so far above a deployment's prefillers; past it they are dropped, and a dropped
#: writer's loads keep dead_prefiller_fence_s.
_MAX_SAME_HOST_WRITERS = 1024
_AVAILABLE_CONGESTION = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")


def _tcp_congestion(choice: str | None) -> str:
    """The algorithms the engine tries on its connections, comma separated in order of
    preference ("" leaves the system's): `choice`, else KVXFER_TCP_CONGESTION, else
    DEFAULT_TCP_CONGESTION. "system" means the system's. A name someone chose that the kernel
    does not offer is an error, not a silent fallback; the default keeps what is offered (a
    kernel built without cubic must not stop every engine from starting)."""
    if choice is None:
        choice = os.environ.get("KVXFER_TCP_CONGESTION", "").strip() or None
    chosen = choice is not None
    if choice is None:
        choice = DEFAULT_TCP_CONGESTION
    if choice == "system":
        return ""
    names = [name.strip() for name in choice.split(",") if name.strip()]
    if not names:
        raise EngineError(f'tcp_congestion {choice!r}: expected algorithm names or "system"')
    try:
        offered = _AVAILABLE_CONGESTION.read_text().split()
    except OSError:  # no procfs: the kernel's answer to setsockopt is counted instead
        offered = names
    if not chosen:
        return ",".join(name for name in names if name in offered)
    unknown = [name for name in names if name not in offered]
    if unknown:
        raise EngineError(f"tcp_congestion {', '.join(unknown)} not offered by this kernel "
                          f"(tcp_available_congestion_control: {' '.join(offered)}); "
                          'use those or "system"')
    return ",".join(names)


def available_providers() -> list[str]:
    """libfabric providers on this machine that support RDM endpoints with RMA."""
    return list(_native.available_providers())


def _buffer_address(buf: Any) -> tuple[int, int, Any]:
    """Returns (address, length, owner) of a contiguous writable buffer.

    Accepts torch tensors (by duck typing, so torch is not imported here), numpy arrays,
    bytearray and writable memoryviews; `owner` is what must stay alive while registered.
    """
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):
        if not buf.is_contiguous():
            raise BoundsError("tensor must be contiguous to be registered")
        if getattr(buf, "is_cuda", False):
            # CUDA memory needs FI_HMEM, which Debian's libfabric is built without.
            raise EngineError("CUDA tensors cannot be registered by this build (host memory only): move device "
                              "pages through pinned host memory with kvxfer.transfer.device_staging")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size()), buf
    if isinstance(buf, np.ndarray):
        if not buf.flags["C_CONTIGUOUS"]:
            raise BoundsError("numpy array must be C-contiguous to be registered")
        if not buf.flags["WRITEABLE"]:
            raise BoundsError("numpy array must be writable to be registered")
        return int(buf.ctypes.data), int(buf.nbytes), buf
    if isinstance(buf, (bytearray, memoryview)):
        view = memoryview(buf)
        if view.readonly:
            raise BoundsError("buffer must be writable to be registered")
        if not view.c_contiguous:
            raise BoundsError("buffer must be contiguous to be registered")
        view = view.cast("B")
        if view.nbytes == 0:
            raise BoundsError("cannot register an empty buffer")
        holder = (ctypes.c_char * view.nbytes).from_buffer(view)
        return ctypes.addressof(holder), view.nbytes, (buf, view, holder)
    raise BoundsError(
        f"cannot register {type(buf).__name__}: use a torch tensor, numpy array, bytearray "
        "or writable memoryview"
    )


def page_array(pages: PageList, name: str) -> np.ndarray:
    """Page indices as a one-dimensional int64 array (a tensor, list or array; zero-copy when
    it already is one); `BoundsError` naming `name` for any other shape or type."""
    if hasattr(pages, "detach") and hasattr(pages, "numpy"):
        pages = pages.detach().cpu().numpy()
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise BoundsError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise BoundsError(f"{name} must hold integers, got {arr.dtype}")
    # Zero-copy when the caller already passes contiguous int64.
    return np.ascontiguousarray(arr, dtype=np.int64)


class RegisteredMemory:
    """A buffer registered with every rail of an engine.

    `descriptor` is the serialized handle (bytes, picklable) that a peer passes to
    `write`/`write_paged` to write into this buffer; it carries the region size, the
    per-rail keys and the owner's address.
    """

    def __init__(self, engine: "TransferEngine", native: Any, owner: Any) -> None:
        self._engine = engine
        self._native = native
        self._owner = owner
        self._registered = True
        self.descriptor: bytes = engine._native.descriptor(native)

    @property
    def length(self) -> int:
        """Size of the region in bytes."""
        return int(self._native.length)

    @property
    def address(self) -> int:
        """Virtual address of the region's first byte."""
        return int(self._native.addr)

    def __repr__(self) -> str:
        return f"RegisteredMemory(addr=0x{self.address:x}, length={self.length})"


class MemoryWindows:
    """Parts of a registered buffer, each registered again with fresh random keys.

    `descriptor` lets a peer write into these parts of the parent buffer only (anything
    else is refused before it is posted, and the keys of the parent are not in it), and
    only until `close()`: after that a fabric write with it fails at the writer and lands
    nothing. Made by `TransferEngine.register_windows`; closing twice is harmless.
    """

    def __init__(self, engine: "TransferEngine", native: Any, parent: RegisteredMemory) -> None:
        self._engine = engine
        self._native = native
        self.parent = parent
        self.descriptor: bytes = engine._native.windows_descriptor(native)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of each window in the parent buffer, sorted."""
        return [(int(o), int(n)) for o, n in self._native.ranges]

    @property
    def closed(self) -> bool:
        """True once the windows' registrations are closed (by `close()` or the engine's)."""
        return bool(self._native.closed)

    def close(self) -> None:
        """Revokes the descriptor: closes every window's registration on every rail."""
        self._engine._native.close_windows(self._native)

    def __repr__(self) -> str:
        return f"MemoryWindows({len(self.ranges)} windows of {self.parent!r}, closed={self.closed})"


class Transfer:
    """Handle of one submitted transfer: wait on it (with a timeout) or await it."""

    def __init__(self, engine: "TransferEngine", native: Any, request_id: Any = None) -> None:
        self._engine = engine
        self._native = native
        self.request_id = request_id

    @property
    def id(self) -> int:
        """Engine-unique transfer id."""
        return int(self._native.id)

    @property
    def bytes(self) -> int:
        """Payload bytes this transfer moves."""
        return int(self._native.bytes)

    @property
    def duration_s(self) -> float | None:
        """Seconds from submission to completion (None while pending)."""
        end = int(self._native.completed_ns)
        return None if end == 0 else (end - int(self._native.submitted_ns)) / 1e9

    @property
    def completed_at_s(self) -> float | None:
        """CLOCK_MONOTONIC time of completion in seconds (compare with time.monotonic())."""
        end = int(self._native.completed_ns)
        return None if end == 0 else end / 1e9

    def done(self) -> bool:
        """True once the transfer finished, successfully or not."""
        return bool(self._native.done())

    def _raise_if_failed(self) -> None:
        status = self._native.status
        if status == _DONE:
            return
        if status == _TIMED_OUT:
            raise TransferTimeout(self.request_id, self._native.error)
        raise TransferError(self.request_id, self._native.error or "transfer failed")

    def wait(self, timeout: float = 30.0) -> None:
        """Blocks until the transfer completes; raises TransferError/TransferTimeout."""
        if not self._native.wait(float(timeout)):
            raise TransferTimeout(self.request_id, f"transfer not complete after {timeout} s")
        self._raise_if_failed()

    def __await__(self) -> Generator[Any, None, None]:
        return self._engine._await_transfer(self).__await__()


class CompletionCounter:
    """What a group of transfers submitted with `write_many`/`write_paged_many` finishes into.

    One counter serves any number of submit calls: keep a deep window in flight by waiting
    for `submitted - window` finished, then submitting more. Reading or waiting takes one
    call, whatever the number of transfers.
    """

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def submitted(self) -> int:
        """Transfers submitted with this counter so far."""
        return int(self._native.submitted)

    @property
    def finished(self) -> int:
        """Transfers of this counter that finished, successfully or not."""
        return int(self._native.finished)

    @property
    def failed(self) -> int:
        """Transfers of this counter that failed or timed out."""
        return int(self._native.failed)

    @property
    def first_error(self) -> str:
        """Why the first failed transfer failed ("" while none has)."""
        return str(self._native.first_error)

    def wait(self, at_least: int | None = None, timeout: float = 30.0) -> None:
        """Blocks until at least `at_least` transfers finished (default: all submitted).

        Raises TransferTimeout at the deadline and TransferError once any transfer of the
        counter failed (with the first failure's reason).
        """
        count = self.submitted if at_least is None else int(at_least)
        if not self._native.wait(max(count, 0), float(timeout)):
            raise TransferTimeout(None, f"{self.finished} of {count} transfers finished after {timeout} s")
        if self._native.failed:
            raise TransferError(None, f"{self.failed} transfers failed; first: {self.first_error}")

    def __repr__(self) -> str:
        return f"CompletionCounter(submitted={self.submitted}, finished={self.finished}, failed={self.failed})"


def _offsets(values: Any, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.dtype != np.int64 and arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise BoundsError(f"{name} must hold integers, got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class _AsyncBridge:
    """Dispatches native engine events to asyncio futures of one event loop."""

    def __init__(self, engine: "TransferEngine", loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._engine = engine
        self.waiters: dict[tuple[int, int], list[asyncio.Future[int]]] = {}
        loop.add_reader(engine._native.event_fd, self._drain)

    def future(self, kind: int, token: int) -> "asyncio.Future[int]":
        fut: asyncio.Future[int] = self.loop.create_future()
        self.waiters.setdefault((kind, token), []).append(fut)
        return fut

    def discard(self, kind: int, token: int, fut: "asyncio.Future[int]") -> None:
        lst = self.waiters.get((kind, token))
        if lst and fut in lst:
            lst.remove(fut)
            if not lst:
                del self.waiters[(kind, token)]

    def _drain(self) -> None:
        for kind, token, status in self._engine._native.take_events():
            for fut in self.waiters.pop((kind, token), []):
                if not fut.done():
                    fut.set_result(status)

    def close(self) -> None:
        try:
            self.loop.remove_reader(self._engine._native.event_fd)
        except (RuntimeError, ValueError):
            pass


class TransferEngine:
    """A kvxfer transfer engine: one-sided WriteImm over libfabric, across `rails` NICs.

    provider: "auto" (best network provider present), "net", "tcp", "shm", "efa", "verbs".
    rails: endpoints (NICs) used as one; transfers are sharded across them and the
        receiver's immediate counts do not depend on the sharding.
    bind_host: address socket providers bind to; default from KVXFER_BIND_HOST, else the
        provider's choice. Tests use 127.0.0.1.
    transfer_timeout_s: a transfer not complete by then fails (dead or stuck peer).
    max_inflight_per_rail: fabric operations in flight per rail (a deep window keeps a TCP
        stream busy with 16 KiB pages); more wait in the engine's queue.
    idle_spin_us: how long the progress worker, with ops in flight and nothing to do,
        yields before it blocks on its fds (their completions wake it). With nothing in
        flight it looks until 2 ms passed without a completion, arrival or submission, then
        blocks: idle, it wakes about 20 times a second (docs/architecture.md, "How the
        worker sleeps").
    delivery_complete: a write completes only once the target holds its bytes (default);
        False completes it when the bytes left this host's buffers (faster on sockets, but
        a completed write may still be in flight).
    same_host: writes to a peer process on this machine (same kernel and PID namespace,
        allowed by ptrace rules) are copied straight into its registered memory, with a
        memcpy into a mapping when the region is a `SharedBuffer`, else with one
        process_vm_writev (it must be on at both ends). `path_to(descriptor)` tells which
        path a region takes. None (the default) reads KVXFER_SAME_HOST (true/false, 1/0,
        yes/no, on/off; unset: on); an explicit True or False wins over the environment
        variable.
    same_host_imm_ring: with same_host, the immediate that follows a same-host write goes
        through a ring in the receiver's shared memory rather than over the provider: lone
        writes of 4 KiB to 1 MiB took 11-18 us less, with 1.2-2x less CPU. Each
        writer engine takes one of the receiver's 64 lanes; without one (or when a lane is
        full) immediates use the provider. engine_stats() counts imm_ring_sent,
        imm_ring_received and imm_ring_fallbacks. False: every immediate uses the provider.
        None (the default) reads KVXFER_SAME_HOST_IMM_RING like same_host its variable.
    tcp_congestion: the TCP congestion control of the connections a socket provider (tcp,
        net) opens for this engine's rails; other sockets of the process are left alone.
        "cubic,reno" by default (names in order of preference: each socket gets the first
        the kernel lets this process set; an unprivileged one may set only
        tcp_allowed_congestion_control, by default reno and the system's default). Why
        not the system's: under BBR without the fq qdisc (this machine's set-up), TCP paces each
        connection with a timer per burst, and the engine, which keeps its send queues
        full, ran at the pacing rate (net, 16 KiB pages at random indices: 1.4-1.5 GB/s
        against 3.7-4.0 GB/s under cubic; benchmarks/README.md). "system" keeps what the
        system chose; names from tcp_available_congestion_control are used as given. None
        reads KVXFER_TCP_CONGESTION (unset: "cubic,reno"). engine_stats() counts
        tcp_congestion_set and tcp_congestion_refused (sockets the kernel let have none).
    cork_sends: TCP_CORK on the engine's own connections (socket providers) around each burst
        of sends its progress thread makes: the ops one round posts, and the acknowledgements
        a poll sends while writes arrive in bursts. A burst then leaves as a few full
        segments instead of a segment per write and per acknowledgement: 4 KiB writes, 256
        in flight over net, 2.1 TCP segments per write and 1.0 GB/s uncorked, 0.22 and
        2.1-2.2 GB/s corked. A lone write is not corked. None reads KVXFER_CORK_SENDS
        (unset: on); engine_stats()["corked_sockets"] is how many connections it corks.
    progress: "thread" (default): a progress thread owns the provider and moves data while
        callers do other things; any thread may use the engine, asyncio included.
        "caller": no progress thread; the thread that created the engine drives progress
        inside its own calls (write, wait, wait_imm, recv) and is the only thread allowed
        to use it. It saves the two thread hand-offs of every transfer: about a third of
        a 4 KiB write's latency on a 2-core machine. Nothing moves between calls, so it
        suits an initiator that submits and waits (not a passive target: its peers' writes
        are acknowledged only while it is inside a call), and it has no asyncio support.
    imm_table_capacity: slots of the immediate table (a power of two; 16 bytes each). With
        imm_admission "any", the distinct values this engine can count in its life: an
        arrival for a new value once all are taken is dropped and counted
        (engine_stats()["imm_table_overflows"]), and waits on such a value raise
        ImmCounterOverflow. With "claimed", the values claimed at one time.
    imm_admission: "any" (default): the first arrival of any value takes a table slot for
        good. "claimed": only values claimed with claim_imm() are counted, until
        release_imm() frees their slot again; an arrival for any other value is dropped
        without taking a slot and counted (engine_stats()["imm_unclaimed_dropped"]). For a
        receiver that knows every value it expects (a decoder's live reservations):
        immediate-only writes need no memory key, only this engine's address, so under
        "any" one sender spraying values could take every slot, and no later reservation
        could be counted.
    inbox_max_messages, inbox_max_bytes: received control messages not yet read by recv()
        are held up to both bounds; beyond them a message is dropped and counted
        (engine_stats()["inbox_dropped_messages"] and ["inbox_dropped_bytes"]).
    populate_on_register: register() faults in every page of the buffer first, so the
        first transfer into fresh memory runs at the warm rate (it ran at 0.23x while the
        copy or the provider faulted pages in one by one). Memory cost: the whole buffer
        becomes resident at registration. False leaves untouched pages unbacked.
    lock_on_register: with populate_on_register, also lock those pages (mlock) where the
        process may (CAP_IPC_LOCK, or room under RLIMIT_MEMLOCK): they are then never
        swapped or reclaimed while registered. Where the kernel refuses, the registration
        goes on unlocked and is counted (engine_stats()["lock_refused"]);
        engine_stats()["locked_bytes"] is what this process holds locked. False never locks.
    huge_pages_on_register: with populate_on_register, ask for transparent huge pages on the
        buffer (madvise MADV_HUGEPAGE, then MADV_COLLAPSE of each 2 MiB span: pages its
        owner had already filled are copied into huge ones; a SharedBuffer's memfd gets
        them this way even where shmem_enabled is never). Same-host copies into private
        memory ran 2.3x faster with them (process_vm_writev pins the target's pages one by
        one), and a 256 MiB SharedBuffer registered in 0.03 s instead of 0.3 s. Only a
        hint: mappings that cannot have them keep small pages. False leaves the mapping as
        it is.
    """

    def __init__(
        self,
        provider: str = "auto",
        rails: int = 1,
        *,
        bind_host: str | None = None,
        transfer_timeout_s: float = 30.0,
        max_inflight_per_rail: int = 256,
        idle_spin_us: float = 30.0,
        shard_min_bytes: int = 512 * 1024,
        delivery_complete: bool = True,
        same_host: bool | None = None,
        progress: str = "thread",
        imm_table_capacity: int = 1 << 16,
        inbox_max_messages: int = 1024,
        inbox_max_bytes: int = 16 * 1024 * 1024,
        populate_on_register: bool = True,
        lock_on_register: bool = True,
        huge_pages_on_register: bool = True,
        same_host_imm_ring: bool | None = None,
        tcp_congestion: str | None = None,
        cork_sends: bool | None = None,
        imm_admission: str = "any",
    ) -> None:
        if not isinstance(rails, int) or rails < 1:
            raise EngineError(f"rails must be a positive integer, got {rails!r}")
        if transfer_timeout_s <= 0:
            raise EngineError("transfer_timeout_s must be > 0")
        if progress not in ("thread", "caller"):
            raise EngineError(f'progress must be "thread" or "caller", got {progress!r}')
        if imm_table_capacity < 2 or imm_table_capacity & (imm_table_capacity - 1):
            raise EngineError(f"imm_table_capacity must be a power of two >= 2, got {imm_table_capacity}")
        if imm_admission not in ("any", "claimed"):
            raise EngineError(f'imm_admission must be "any" or "claimed", got {imm_admission!r}')
        if inbox_max_messages < 1 or inbox_max_bytes < 1:
            raise EngineError("inbox_max_messages and inbox_max_bytes must be >= 1")
        host = bind_host if bind_host is not None else os.environ.get("KVXFER_BIND_HOST", "")
        if same_host is None:
            same_host = _switch_from_env("KVXFER_SAME_HOST")
        if same_host_imm_ring is None:
            same_host_imm_ring = _switch_from_env("KVXFER_SAME_HOST_IMM_RING")
        if cork_sends is None:
            cork_sends = _switch_from_env("KVXFER_CORK_SENDS")
        self._native = _native.Engine(
            provider=provider,
            rails=rails,
            bind_host=host,
            transfer_timeout_s=float(transfer_timeout_s),
            max_inflight_per_rail=int(max_inflight_per_rail),
            idle_spin_us=float(idle_spin_us),
            shard_min_bytes=int(shard_min_bytes),
            delivery_complete=bool(delivery_complete),
            same_host=bool(same_host),
            caller_drives_progress=progress == "caller",
            imm_table_capacity=int(imm_table_capacity),
            inbox_max_messages=int(inbox_max_messages),
            inbox_max_bytes=int(inbox_max_bytes),
            populate_on_register=bool(populate_on_register),
            lock_on_register=bool(lock_on_register),
            huge_pages_on_register=bool(huge_pages_on_register),
            same_host_imm_ring=bool(same_host_imm_ring),
            tcp_congestion=_tcp_congestion(tcp_congestion),
            cork_sends=bool(cork_sends),
            count_claimed_imms_only=imm_admission == "claimed",
        )
        self.progress = progress
        self.imm_admission = imm_admission
        self.transfer_timeout_s = float(transfer_timeout_s)
        self._remote_cache = RemoteDescriptorCache(self._native.parse_remote)
        self._peer_cache: dict[bytes, Any] = {}
        #: engine id -> its pinned same-host writer (watch_same_host_writer); None: not one
        self._same_host_writers: dict[int, Any] = {}
        self._bridges: dict[int, _AsyncBridge] = {}
        self._expect_tokens = iter(range(1, 1 << 62))
        self._token_lock = threading.Lock()
        self._regions: list[RegisteredMemory] = []
        self._pin_cost_checked = False  # register_windows' warning, once per engine

    # -- identity ---------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """This engine's serialized address (every rail): give it to peers."""
        return bytes(self._native.address)

    @property
    def provider(self) -> str:
        """The libfabric provider in use (after resolving "auto")."""
        return str(self._native.provider)

    @property
    def rails(self) -> int:
        """Number of rails (endpoints) this engine drives."""
        return int(self._native.rails)

    @property
    def capabilities(self) -> dict[str, Any]:
        """What the provider reported: MR mode bits, CQ data size, iov limits."""
        return dict(self._native.capabilities)

    # -- memory -----------------------------------------------------------------------
    def register(self, buf: Any) -> RegisteredMemory:
        """Registers a contiguous buffer on every rail and returns its handle.

        A view of a `kvxfer.SharedBuffer` registers as shareable: same-host peers map it and
        write with memcpy instead of process_vm_writev.
        """
        addr, length, owner = _buffer_address(buf)
        shared = shared_buffer_of(addr, length)
        if shared is None:
            native = self._native.register(addr, length)
        else:
            native = self._native.register(addr, length, shared.fd, addr - shared.address)
            owner = (owner, shared)  # its memfd must stay open while peers may map it
        region = RegisteredMemory(self, native, owner)
        self._regions.append(region)
        return region

    def deregister(self, region: RegisteredMemory) -> None:
        """Releases a registration; the buffer must not be the target of writes any more."""
        self._native.deregister(region._native)
        region._registered = False
        self._regions.remove(region)

    def register_windows(self, region: RegisteredMemory, ranges: list[tuple[int, int]]) -> MemoryWindows:
        """Registers each (offset, length) of `region` again with fresh keys (see `MemoryWindows`).

        Ranges must be non-empty, inside the region and disjoint (`BoundsError`). Costs one
        provider registration per window per rail: see benchmarks/bench_registration.py. On
        a provider that pins memory, the first call warns (once per engine) when `region`
        has too few huge pages for that to be cheap (kvxfer/transfer/registration_cost.py).
        """
        local = self._local(region)
        if not self._pin_cost_checked:
            self._pin_cost_checked = True
            warning = per_reservation_pin_warning(self.provider, region.address, region.length)
            if warning:
                log.warning(warning)
        native = self._native.register_windows(local, [(int(o), int(n)) for o, n in ranges])
        return MemoryWindows(self, native, region)

    def _local(self, mr: Any) -> Any:
        # The native layer trusts its region handle: a raw buffer, another engine's region or
        # a deregistered one would be posted with keys this engine's rails do not hold.
        if not isinstance(mr, RegisteredMemory):
            raise EngineError(
                f"source must be a RegisteredMemory returned by register(), got {type(mr).__name__}"
            )
        if mr._engine is not self:
            raise EngineError(f"{mr!r} is registered with another engine")
        if not mr._registered:
            raise EngineError(f"{mr!r} was deregistered")
        return mr._native

    def _remote(self, descriptor: bytes) -> Any:
        if not isinstance(descriptor, (bytes, bytearray, memoryview)):
            raise BoundsError("remote descriptor must be bytes (RegisteredMemory.descriptor)")
        return self._remote_cache.get(bytes(descriptor))

    def remote_length(self, descriptor: bytes) -> int:
        """The byte length of the region a peer's descriptor (`RegisteredMemory.descriptor`)
        names, read from the descriptor as a write would read it.

        For checking offsets a peer sent against its own region before any write is posted.
        A descriptor that is not bytes raises BoundsError; one that does not parse raises the
        engine's error for it (KvxferError or ValueError), naming what is wrong.
        """
        return int(self._remote(descriptor).length)

    def _peer(self, target: bytes) -> Any:
        key = bytes(target)
        peer = self._peer_cache.get(key)
        if peer is None:
            if key[:4] == b"KVXD":
                peer = self._native.parse_peer(self._remote(key).owner_address)
            else:
                peer = self._native.parse_peer(key)
            if len(self._peer_cache) > 4096:
                self._peer_cache.clear()
            self._peer_cache[key] = peer
        return peer

    def path_to(self, remote_descriptor: bytes) -> str:
        """How writes to that region travel: "same_host_mapped" (memcpy into the owner's
        SharedBuffer, mapped here), "same_host" (process_vm_writev), or "fabric" (the
        libfabric provider)."""
        remote = self._remote(remote_descriptor)
        if remote.mapped:
            return "same_host_mapped"
        return "same_host" if remote.same_host else "fabric"

    # -- transfers --------------------------------------------------------------------
    def write(
        self,
        mr: RegisteredMemory,
        src_offset: int,
        remote_descriptor: bytes,
        dst_offset: int,
        length: int,
        imm: int | None = None,
        *,
        request_id: Any = None,
    ) -> Transfer:
        """One-sided write of mr[src_offset:+length] into the remote region at dst_offset.

        With `imm`, the receiver's count for that immediate grows by one once every byte
        landed, however the engine sharded the write across rails.
        """
        native = self._native.write(
            self._local(mr), src_offset, self._remote(remote_descriptor), dst_offset, length, imm
        )
        return Transfer(self, native, request_id)

    def write_paged(
        self,
        mr: RegisteredMemory,
        src_pages: PageList,
        remote_descriptor: bytes,
        dst_pages: PageList,
        page_size: int,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        *,
        request_id: Any = None,
    ) -> Transfer:
        """Writes page src_pages[i] to remote page dst_pages[i] for every i.

        Page p of a side lives at offset + p * stride (stride defaults to page_size). Every
        index is validated before anything is posted. With `imm`, the receiver's count
        grows by one per page, however pages were coalesced or sharded.
        """
        src = page_array(src_pages, "src_pages")
        dst = page_array(dst_pages, "dst_pages")
        native = self._native.write_paged(
            self._local(mr),
            src,
            self._remote(remote_descriptor),
            dst,
            page_size,
            page_size if src_stride is None else src_stride,
            page_size if dst_stride is None else dst_stride,
            src_offset,
            dst_offset,
            imm,
        )
        return Transfer(self, native, request_id)

    def completion_counter(self) -> CompletionCounter:
        """A new counter for `write_many`/`write_paged_many` to finish transfers into."""
        return CompletionCounter(self._native.completion_counter())

    def _counter(self, counter: CompletionCounter) -> Any:
        if not isinstance(counter, CompletionCounter):
            raise EngineError(f"counter must come from completion_counter(), got {type(counter).__name__}")
        return counter._native

    def write_many(
        self,
        mr: RegisteredMemory,
        src_offsets: Sequence[int] | np.ndarray,
        remote_descriptor: bytes,
        dst_offsets: Sequence[int] | np.ndarray,
        length: int | Sequence[int] | np.ndarray,
        imm: int | None = None,
        *,
        counter: CompletionCounter,
    ) -> int:
        """Submits one write per (src_offsets[i], dst_offsets[i]) in one call; returns how many.

        Each is a `write` of its own (`length` bytes, or length[i]; with `imm`, one unit
        each) that finishes into `counter` instead of returning a handle. Every write is
        validated before any is submitted: a bad one raises BoundsError and none goes out.
        """
        return int(
            self._native.write_many(
                self._local(mr),
                _offsets(src_offsets, "src_offsets"),
                self._remote(remote_descriptor),
                _offsets(dst_offsets, "dst_offsets"),
                _offsets(length, "length"),
                imm,
                self._counter(counter),
            )
        )

    def write_paged_many(
        self,
        mr: RegisteredMemory,
        src_page_lists: Sequence[PageList],
        remote_descriptor: bytes,
        dst_page_lists: Sequence[PageList],
        page_size: int,
        src_stride: int | None = None,
        dst_stride: int | None = None,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        *,
        counter: CompletionCounter,
    ) -> int:
        """Submits one `write_paged` per pair of page lists in one call; returns how many.

        Page lists are read in place (int64 NumPy arrays are not copied). Each write
        finishes into `counter`; all are validated before any is submitted.
        """
        src = [page_array(p, "src_pages") for p in src_page_lists]
        dst = [page_array(p, "dst_pages") for p in dst_page_lists]
        return int(
            self._native.write_paged_many(
                self._local(mr),
                src,
                self._remote(remote_descriptor),
                dst,
                page_size,
                page_size if src_stride is None else src_stride,
                page_size if dst_stride is None else dst_stride,
                src_offset,
                dst_offset,
                imm,
                self._counter(counter),
            )
        )

    def write_imm(self, target: bytes, imm: int, *, request_id: Any = None) -> Transfer:
        """Immediate-only write (no payload) to a peer, given its address or a descriptor."""
        return Transfer(self, self._native.write_imm(self._peer(target), imm), request_id)

    def barrier(self, targets: Iterable[bytes], imm: int, timeout: float = 30.0) -> None:
        """Sends `imm` to every target and waits until each delivery completed."""
        transfers = [self.write_imm(t, imm) for t in targets]
        for t in transfers:
            t.wait(timeout)

    def send(self, target: bytes, payload: bytes) -> Transfer:
        """Two-sided control message (at most 64 KiB) to a peer's address or descriptor."""
        return Transfer(self, self._native.send(self._peer(target), bytes(payload)))

    def recv(self, timeout: float) -> bytes | None:
        """Next control message received, or None if none arrived within `timeout`."""
        return self._native.recv(float(timeout))

    def connect(self, address: bytes) -> None:
        """Adds a peer now instead of at its first transfer."""
        self._native.connect(self._peer(address))

    def bind_imm_source(self, imm: int, address: bytes) -> bool:
        """Credits `imm` from now on only with arrivals sent by the engine at `address`.

        Arrivals of `imm` from any other sender are dropped and counted
        (`engine_stats()["imm_foreign_dropped"]`). Each rail of ours accepts the peer's rail
        that writes to it. Returns False, binding nothing, where the provider cannot name a
        completion's sender (`capabilities["source"]` False: no FI_SOURCE, or shm) or the
        peer has more rails than this engine. The senders of RMA-write completions are not
        reliable on every provider: see docs/architecture.md, "Data plane".
        """
        return bool(self._native.bind_imm_source(int(imm), self._peer(address)))

    def unbind_imm_source(self, imm: int) -> None:
        """Lets any sender's arrivals count for `imm` again (see `bind_imm_source`)."""
        self._native.unbind_imm_source(int(imm))

    def claim_imm(self, imm: int) -> None:
        """Counts arrivals for `imm` from now on (see `imm_admission`; under "any" every
        value is counted anyway). Raises ImmCounterOverflow when every table slot holds
        another claimed value."""
        self._native.claim_imm(int(imm))

    def release_imm(self, imm: int) -> None:
        """Stops counting `imm` (its arrivals are dropped again), frees its table slot and
        unbinds its sender. Call it only once nothing will read, consume or reset `imm`
        any more: its slot may count another value at once."""
        self._native.release_imm(int(imm))

    def forget(self, address: bytes) -> None:
        """Drops a peer that went away; a later transfer to it reconnects."""
        peer = self._peer(address)
        self._native.forget(peer)
        self._same_host_writers.pop(peer.engine_id, None)
        self._peer_cache = {k: v for k, v in self._peer_cache.items() if v is not peer}
        self._remote_cache.forget_owner(peer.engine_id)

    def sever_peer(self, address: bytes) -> bool:
        """Cuts this process's TCP connections to the engine at `address` (a dead writer),
        on the thread that runs the provider's progress; True where that proves that no
        byte from it lands in this process's memory after this returns.

        Each connection to one of its rail addresses is shut down (Linux queues no new data
        on it after that) and what its receive queue held is read and dropped before the
        call returns, so the provider reads EOF or an error and drops the op it was
        receiving. True only where, besides those, no socket of this process may carry the
        peer's bytes: none that our listeners accepted from its host (the peer opened it,
        from a port that names no one), no reset connection with unread bytes (a reset
        leaves no peer address to tell whose), the provider is net or tcp (no progress
        thread of its own), and the peer cannot write through the same-host path (no socket
        to cut) or is a pinned same-host writer whose process can no longer write
        (`same_host_writes_ended`, checked first). A connection the provider already closed
        counts as cut. False proves nothing and touches no other peer's connection. A
        connection opened after this is not prevented: revoke the registrations first, so
        that an op on it is refused at its header (net checks a write's key at the op's
        header)."""
        peer = self._peer(address)
        # The same-host writes' end is proven before the sever: each proves from its own
        # moment on, so after both no byte of the peer lands by either way.
        writes_ended = self.same_host_writes_ended(address) == ""
        proven, per_rail = self._native.sever_peer(peer, writes_ended)
        log.debug("severed connections to a peer, per rail: %s (proven: %s)", per_rail, proven)
        return bool(proven)

    def watch_same_host_writer(self, address: bytes) -> bool:
        """Pins the process of the engine at `address` if it can write into this one through
        the same-host path (same kernel and PID namespace, this engine offering the path):
        a pidfd of the pid its address declares, checked to be that engine's process. Call
        it while the peer runs (before it may write), so that a later `sever_peer` can prove
        its same-host writes ended (`same_host_writes_ended`). Returns whether it is such a
        writer and is pinned; idempotent, at most _MAX_SAME_HOST_WRITERS kept.

        Trusting the pid the peer declares is safe for what it proves: a process that can
        write here by the same-host path holds ptrace rights over this one and could write
        anything anyway; the proof is about an honest writer's copy in flight when it died.
        """
        peer = self._peer(address)
        if peer.engine_id not in self._same_host_writers:
            if len(self._same_host_writers) >= _MAX_SAME_HOST_WRITERS:
                self._same_host_writers.clear()  # unpinned writers keep dead_prefiller_fence_s: safe
            self._same_host_writers[peer.engine_id] = self._native.open_same_host_writer(peer)
        return self._same_host_writers[peer.engine_id] is not None

    def same_host_writes_ended(self, address: bytes) -> str | None:
        """Whether the pinned same-host writer at `address` (`watch_same_host_writer`) can no
        longer write here: "" once every thread of its process is exiting or gone (a killed
        process runs no more user code and enters no new system call, so no copy of it is
        under way or can start), else why not; None where it is not a pinned same-host
        writer (the path proves nothing for it). Never blocks; reads /proc."""
        writer = self._same_host_writers.get(self._peer(address).engine_id)
        return None if writer is None else str(writer.still_writing())

    # -- ImmCounter -------------------------------------------------------------------
    def imm_count(self, imm: int) -> int:
        """Units of `imm` received so far (pages for paged writes, 1 per other write)."""
        return int(self._native.imm_count(imm))

    def wait_imm(self, imm: int, count: int, timeout: float) -> None:
        """Blocks until `count` units of `imm` arrived; raises TransferTimeout otherwise, and
        ImmCounterOverflow at once when `imm` cannot be counted (its table is full)."""
        if not self._native.wait_imm(imm, count, float(timeout)):
            raise TransferTimeout(
                None, f"imm {imm}: {self.imm_count(imm)} of {count} arrived within {timeout} s"
            )

    def wait_imm_any(self, wanted: Sequence[tuple[int, int]], timeout: float,
                     watched_fds: Sequence[int] = ()) -> int | None:
        """Blocks until one of `wanted` ((imm, count) pairs) has `count` units, or can no
        longer be counted (see wait_imm: its imm_count then stays short); returns its index,
        or None once `timeout` seconds passed (at once for an empty list), or as soon as one
        of `watched_fds` (connected sockets) reports its peer's close or an error. The one
        wait for many pending loads: it wakes for whichever completes first, not the oldest,
        or for a peer that is gone, without waking up in between to look."""
        if not wanted:
            return None
        found = int(self._native.wait_imm_any([(int(i), int(c)) for i, c in wanted], float(timeout),
                                              [int(fd) for fd in watched_fds]))
        return found if found >= 0 else None

    def consume_imm(self, imm: int, count: int) -> None:
        """Subtracts a finished request's units so the immediate value can be reused."""
        self._native.consume_imm(imm, count)

    def reset_imm(self, imm: int) -> None:
        """Forgets everything counted for `imm`, partial shards included.

        Only for an immediate no write can still arrive for (its sender finished, failed
        or passed its transfer deadline); otherwise use consume_imm.
        """
        self._native.reset_imm(imm)

    async def wait_imm_async(self, imm: int, count: int, timeout: float) -> None:
        """Awaitable wait_imm: no thread is parked while waiting."""
        self._check_async()
        if self.imm_count(imm) >= count:
            return
        bridge = self._bridge()
        with self._token_lock:
            token = next(self._expect_tokens)
        fut = bridge.future(_EVENT_IMM, token)
        self._native.expect_imm(imm, count, token)
        try:
            status = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            bridge.discard(_EVENT_IMM, token, fut)
            raise TransferTimeout(
                None, f"imm {imm}: {self.imm_count(imm)} of {count} arrived within {timeout} s"
            ) from None
        if status == _FAILED:
            stats = self.engine_stats()
            raise ImmCounterOverflow(
                f"imm {imm}: {self.imm_count(imm)} of {count} arrived, and no more can be "
                f"counted: the immediate table is full ({stats['imm_table_capacity']} distinct "
                f"values, imm_table_capacity) and {stats['imm_table_overflows']} arrivals were dropped"
            )

    def on_imm(self, imm: int, count: int, callback: Callable[[], None]) -> None:
        """Calls `callback` in the running event loop once `count` units of `imm` arrived."""
        task = asyncio.get_running_loop().create_task(
            self.wait_imm_async(imm, count, self.transfer_timeout_s)
        )
        task.add_done_callback(lambda t: None if t.exception() else callback())

    # -- asyncio ----------------------------------------------------------------------
    def _check_async(self) -> None:
        if self.progress == "caller":
            # Events come from the progress thread, and this engine has none.
            raise EngineError('asyncio needs an engine with progress="thread"')

    def _bridge(self) -> _AsyncBridge:
        loop = asyncio.get_running_loop()
        bridge = self._bridges.get(id(loop))
        if bridge is None or bridge.loop is not loop:
            bridge = _AsyncBridge(self, loop)
            self._bridges[id(loop)] = bridge
        return bridge

    async def _await_transfer(self, transfer: Transfer) -> None:
        self._check_async()
        if not transfer.done():
            bridge = self._bridge()
            fut = bridge.future(_EVENT_TRANSFER, transfer.id)
            if transfer._native.request_notify():
                bridge.discard(_EVENT_TRANSFER, transfer.id, fut)
            else:
                # The worker fails the transfer by its own deadline; this is a backstop.
                try:
                    await asyncio.wait_for(fut, self.transfer_timeout_s + 5.0)
                except asyncio.TimeoutError:
                    bridge.discard(_EVENT_TRANSFER, transfer.id, fut)
        if not transfer.done():
            raise TransferTimeout(transfer.request_id, "transfer did not complete")
        transfer._raise_if_failed()

    # -- lifecycle --------------------------------------------------------------------
    def stats(self) -> list[dict[str, int]]:
        """Per-rail counters: bytes/ops posted and completed, completion errors, imms."""
        return [dict(s) for s in self._native.stats()]

    def engine_stats(self) -> dict[str, int]:
        """Engine-wide counters: imm_table_overflows (arrivals dropped because the immediate
        table was full) and imm_table_capacity; imm_unclaimed_dropped (arrivals for values
        nobody claimed, under imm_admission "claimed") and imm_claimed (values claimed now);
        inbox_dropped_messages/_bytes (control
        messages dropped because the unread inbox was at a bound) and what the inbox holds
        now (inbox_messages, inbox_bytes); lock_refused (registrations the kernel would not
        lock) and locked_bytes (locked by every engine of this process); imm_ring_sent,
        imm_ring_received and imm_ring_fallbacks (immediates through same-host immediate
        rings: see same_host_imm_ring); tcp_congestion_set and tcp_congestion_refused
        (sockets of its connections switched to tcp_congestion, and refused); worker_wakeups
        (times the progress worker came out of a sleep: about 20 a second when idle, 1,000
        on shm, which has no wait fd); corked_sockets (connections cork_sends corks, found at
        its last look)."""
        return dict(self._native.engine_stats())

    def same_host_stats(self) -> dict[str, int]:
        """The same-host path's counters (one op per copy slice), keyed like a rail's."""
        stats = self._native.same_host_stats()
        return {} if stats is None else dict(stats)

    def path_stats(self) -> dict[str, dict[str, int]]:
        """Counters of every path: rails by index ("0", "1", ...) and "same_host"."""
        out: dict[str, dict[str, int]] = {str(i): s for i, s in enumerate(self.stats())}
        same_host = self.same_host_stats()
        if same_host:
            out["same_host"] = same_host
        return out

    def close(self) -> None:
        """Stops the progress thread; pending transfers fail with 'engine closed'."""
        for bridge in self._bridges.values():
            bridge.close()
        self._bridges.clear()
        self._native.close()

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return bool(self._native.closed)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine(provider={self.provider!r}, rails={self.rails})"
