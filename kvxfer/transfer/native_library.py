"""kvxfer's native extension (`kvxfer._native`), loaded without the signal handlers that
libfabric's dependencies install.

Debian's libfabric links the psm provider, and its libinfinipath installs handlers for
SIGSEGV, SIGBUS, SIGILL, SIGABRT and SIGTERM as soon as it is loaded: they print a
backtrace ("python:N terminated with signal 6 at PC=...") and call exit() inside the
handler. A crash then runs the exit handlers from a signal handler, and a process that
should die can hang instead: one test-suite run deadlocked with two threads in exit()
after a malloc corruption met there. SIGTERM would also skip Python's default (die) for
exit(). So the dispositions are put back as they were before the load, and faulthandler,
when it is on, is registered again above them.

Before the load, libfabric's registration caches are turned off (`REGISTRATION_CACHE_OFF`).
libfabric keeps a closed registration alive in a cache for reuse on providers that pin
memory (verbs and the others on its MR cache; EFA has its own), and hands a later
fi_mr_reg of a range inside a cached one that registration and its key. A per-reservation
window closed at admission, abort or timeout would then stay writable under its key, and
its "fresh" key could be an older one. kvxfer makes and closes its registrations itself,
so closed must mean revoked; the caches save nothing for it. libfabric reads these
variables once, at its first call in the process, so they are set here, before any. A
value the user set is kept, with a warning when it turns a cache back on.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading

_OVERRIDDEN = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGTERM)

#: libfabric variables that turn its registration caches off (fi_mr(3), fi_efa(7)).
REGISTRATION_CACHE_OFF = {
    "FI_MR_CACHE_MONITOR": "disabled",  # the util MR cache: no monitor, no cache
    "FI_MR_CACHE_MAX_COUNT": "0",  # the same cache, for libfabric builds without the monitor switch
    "FI_EFA_MR_CACHE_ENABLE": "0",  # EFA's own cache
}

log = logging.getLogger("kvxfer.transfer")


def registration_caches_off(environ: "os._Environ[str] | dict[str, str]") -> list[str]:
    """Sets each of `REGISTRATION_CACHE_OFF` that `environ` lacks; returns "NAME=value" for
    those already set otherwise (a cache the user turned back on)."""
    kept = []
    for name, off in REGISTRATION_CACHE_OFF.items():
        value = environ.setdefault(name, off)
        if value.strip().lower() != off:
            kept.append(f"{name}={value}")
    return kept


def _load() -> object:
    kept = registration_caches_off(os.environ)
    if kept:
        log.warning("libfabric registration cache left on by %s: on providers that pin memory (verbs, efa) a "
                    "registration kvxfer closes may stay writable by a peer that holds its key", ", ".join(kept))
    main_thread = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in _OVERRIDDEN}
    from kvxfer import _native

    if main_thread:  # signal.signal() works only there; other importers keep the library's handlers
        for sig, handler in before.items():
            if handler is not None:  # None: set outside Python, not ours to put back
                signal.signal(sig, handler)
        if faulthandler.is_enabled():
            faulthandler.disable()
            faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)
    return _native


native = _load()

__all__ = ["native"]
