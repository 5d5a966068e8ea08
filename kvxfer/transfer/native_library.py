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
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading

_OVERRIDDEN = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGTERM)


def _load() -> object:
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
