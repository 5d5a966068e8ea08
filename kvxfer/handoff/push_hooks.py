"""Injection points of a KV push, given from outside: how tests and failure drills make a
push go wrong without a branch for them in the push itself.

A `PushSession` calls its `PushHooks` at three points of every layer it pushes: before the
layer (on the compute thread, outside the session's lock: a hook may block or raise), after
the layer's local pages are final but before they are checksummed (a hook may change them),
and when the layer's writes are planned (a hook may change the list of paged writes). The
base class does nothing at each point: it is what production runs. A worker gets its hooks
at construction; the worker process names a factory by the `push_hooks` setting
("module:callable" or "file.py:callable", loaded by `load_hooks`), so a test harness or a drill selects its own
module by environment variable and the production modules never import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from kvxfer.handoff.push_session import PushSession

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


def load_hooks(spec: str, kind: type[HooksT], **config: Any) -> HooksT:
    """The hooks object a "module:callable" spec makes, called with `config`.

    For the `push_hooks`-style settings of workers and the connector. The module is a
    module name (imported as such, so it may live outside the package where the process's
    path reaches it) or a path to a .py file (loaded from there). What the callable returns
    must be a `kind`. ValueError naming the spec otherwise.
    """
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"hooks {spec!r}: expected 'module:callable' or 'path/to/file.py:callable'")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"no module at {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except (ImportError, AttributeError, OSError) as exc:
        raise ValueError(f"hooks {spec!r}: cannot load it: {exc}") from None
    hooks = factory(**config)
    if not isinstance(hooks, kind):
        raise ValueError(f"hooks {spec!r} made a {type(hooks).__name__}, not a {kind.__name__}")
    log.warning("hooks from %s in use: %r", spec, hooks)
    return hooks
