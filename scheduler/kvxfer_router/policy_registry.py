"""The pair policies by name: ``make_policy(settings.policy, settings)`` builds the router's.

A module of its own above ``policies`` and ``kv_aware``: ``kv_aware`` builds on the load
policies, and the names of all of them are listed here, so neither imports the other back.
"""

from __future__ import annotations

from typing import Callable

from .kv_aware import KvAwarePolicy
from .policies import LeastLoadedPolicy, PairPolicy, RoundRobinPolicy
from .settings import RouterSettings

_POLICIES: dict[str, Callable[[RouterSettings], PairPolicy]] = {
    RoundRobinPolicy.name: lambda _settings: RoundRobinPolicy(),
    LeastLoadedPolicy.name: lambda _settings: LeastLoadedPolicy(),
    KvAwarePolicy.name: KvAwarePolicy,
}


def register_policy(name: str, factory: Callable[[], PairPolicy]) -> None:
    """Make a policy selectable by ``name`` (setting ``policy``); replaces an existing one."""
    _POLICIES[name] = lambda _settings: factory()


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`."""
    return sorted(_POLICIES)


def make_policy(name: str, settings: RouterSettings | None = None) -> PairPolicy:
    """A fresh policy instance for ``name``, configured from ``settings`` (``RouterSettings()``
    when left out); ``ValueError`` listing the known names if unknown."""
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}") from None
    return factory(settings if settings is not None else RouterSettings())


__all__ = ["make_policy", "policy_names", "register_policy"]
