"""Typed errors of kvxfer. Every error the library raises derives from KvxferError.

The native engine raises EngineError and its subclasses directly (bindings.cpp maps its
C++ exceptions onto these classes), so callers catch one family whichever layer failed.
"""

from __future__ import annotations


class KvxferError(Exception):
    """Base of every kvxfer error."""


class EngineError(KvxferError):
    """The transfer engine refused or failed an operation (bad provider, closed engine...)."""


class DescriptorError(EngineError, ValueError):
    """A serialized address or memory descriptor is truncated, corrupt or foreign."""


class BoundsError(EngineError, ValueError):
    """An offset, length or page index falls outside a registered region."""


class TransferError(EngineError):
    """A transfer failed; carries the request it belonged to and the reason."""

    def __init__(self, request_id: str | int | None, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        prefix = f"request {request_id}: " if request_id is not None else ""
        super().__init__(prefix + reason)


class TransferTimeout(TransferError, TimeoutError):
    """A transfer or an immediate count did not complete before its deadline."""


class ImmCounterOverflow(EngineError):
    """An immediate's arrivals could not be counted: the engine's immediate table is full
    (imm_table_capacity distinct values), so a wait on it fails instead of timing out."""


class RegistryError(KvxferError):
    """A registry operation failed; the message names the key or endpoints involved.

    Raised for configuration mistakes (bad update fields, calling `update` before
    `register`) and when etcd cannot be reached within the configured timeout.
    Background threads never raise it: they log, back off and retry.
    """


class RegistryTimeoutError(RegistryError):
    """A wait on the registry (first registration, first sync, `wait_for`) ran out of time."""
