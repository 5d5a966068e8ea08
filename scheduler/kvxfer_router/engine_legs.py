"""Which leg type serves each engine kind: the one mapping from a registry record's
``engine`` to the :class:`~kvxfer_router.legs.RequestLegs` that run requests on it.

A pair is only ever made of workers of one engine (``policies.compatible``), so the leg
type is looked up once per attempt, from the pair the policy chose. A new engine kind is a
new leg type and one line here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .builtin_legs import BuiltinLegs
from .directory import WorkerView
from .legs import RequestLegs
from .vllm_legs import VllmLegs

#: Registry engine -> the leg type of its workers.
LEG_TYPES: Mapping[str, RequestLegs] = {
    "kvxfer": BuiltinLegs(),  # kvxfer's own workers (POST /reserve, /prefill, /generate)
    "vllm": VllmLegs(),       # vLLM's OpenAI server with the kvxfer connector
}


class UnknownEngine(ValueError):
    """A worker's registry ``engine`` names no leg type this router has."""

    def __init__(self, engine: str) -> None:
        super().__init__(f"no leg type for engine {engine!r}; this router serves {', '.join(sorted(LEG_TYPES))}")
        self.engine = engine


def legs_for(engine: str) -> RequestLegs:
    """The leg type for workers of ``engine``; :class:`UnknownEngine` for one the router lacks."""
    try:
        return LEG_TYPES[engine]
    except KeyError:
        raise UnknownEngine(engine) from None


def reports_prefix_index(worker: WorkerView) -> bool:
    """Whether ``worker`` answers ``POST /prefix_index`` (its leg type says so)."""
    legs = LEG_TYPES.get(worker.engine)
    return legs is not None and legs.reports_prefix_index


def relays_client_body(engines: Iterable[str]) -> bool:
    """Whether a model served by workers of ``engines`` gets the client's body as it is (some
    of them relay it: the body must then follow their schema, not the router's)."""
    return any(LEG_TYPES[engine].relays_client_body for engine in engines if engine in LEG_TYPES)


__all__ = ["LEG_TYPES", "UnknownEngine", "legs_for", "relays_client_body", "reports_prefix_index"]
