"""Injection points of a KV push, given from outside: how tests and failure drills make a
push go wrong without a branch for them in the push itself.

A `PushSession` calls its `PushHooks` at three points of every layer it pushes: before the
layer (on the compute thread, outside the session's lock: a hook may block or raise), after
the layer's local pages are final but before they are checksummed (a hook may change them),
and when the layer's writes are planned (a hook may change the list of paged writes). The
base class does nothing at each point: it is what production runs. A worker gets its hooks
at construction; the worker process names a factory by the `push_hooks` setting
("module:callable", loaded by `load_hooks`), so a test harness or a drill selects its own
module by environment variable and the production modules never import it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from kvxfer.kv.push import PushSession

log = logging.getLogger("kvxfer.hooks")

#: One paged write of a layer: local page ids, and the decoder's page ids they land in.
PageWrite = tuple[np.ndarray, np.ndarray]


class PushHooks:
    """Called by a `PushSession` at each layer; this base does nothing (production).

    Subclasses (tests, drills) override any of the three points. They are called on the
    compute thread of the push, once per (layer, chunk) with pages to push.
    """

    def before_layer(self, push: PushSession, layer: int, first_block: int) -> None:
        """Blocks [first_block, ...) of `layer` are final and about to be pushed; nothing of
        them is written yet. May wait, or raise a TransferError that fails the push."""

    def before_checksum(self, push: PushSession, layer: int, local: np.ndarray) -> None:
        """The local pages `local` of `layer` are about to be checksummed and written; may
        change their bytes in `push.cache` (the checksums will agree with the change)."""

    def layer_writes(self, push: PushSession, layer: int, local: np.ndarray, remote: np.ndarray) -> Sequence[PageWrite]:
        """The paged writes to post for these pages, after their checksums were taken: by
        default one write of every page to its reserved page."""
        return ((local, remote),)


#: The hooks of a push nobody hooks into.
NO_PUSH_HOOKS = PushHooks()

HooksT = TypeVar("HooksT")


def load_hooks(spec: str, kind: type[HooksT]) -> HooksT:
    """The hooks object a "module:callable" spec makes (the callable takes no arguments).

    For the `push_hooks`-style settings of workers and the connector: the module is imported
    by name (so it may live outside the package, e.g. a test harness's), and what the
    callable returns must be a `kind`. ValueError naming the spec otherwise.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"hooks {spec!r}: expected 'module:callable'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"hooks {spec!r}: cannot load it: {exc}") from None
    hooks = factory()
    if not isinstance(hooks, kind):
        raise ValueError(f"hooks {spec!r} made a {type(hooks).__name__}, not a {kind.__name__}")
    log.warning("hooks from %s in use: %r", spec, hooks)
    return hooks
