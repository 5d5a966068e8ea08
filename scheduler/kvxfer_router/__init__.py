"""kvxfer router: OpenAI-compatible entry point that pairs prefill and decode workers.

``create_app(settings, directory)`` builds the FastAPI app; ``python -m kvxfer_router`` runs
it against the etcd registry. Importing the package starts nothing.
"""

from __future__ import annotations

from .app import create_app
from .directory import EtcdWorkerDirectory, StaticWorkerDirectory, WorkerDirectory, WorkerView
from .policies import LeastLoadedPolicy, PairPolicy, RoundRobinPolicy
from .policy_registry import make_policy, register_policy
from .settings import RouterSettings

__all__ = [
    "EtcdWorkerDirectory",
    "LeastLoadedPolicy",
    "PairPolicy",
    "RoundRobinPolicy",
    "RouterSettings",
    "StaticWorkerDirectory",
    "WorkerDirectory",
    "WorkerView",
    "create_app",
    "make_policy",
    "register_policy",
]
