"""kvxfer inside vLLM: `KvxferConnector`, a KVConnectorBase_V1 that vLLM loads with
`"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm"`.

Needs the `vllm` extra (`pip install kvxfer[vllm]`); nothing else in kvxfer imports this.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvxferConnector"]


def __getattr__(name: str) -> Any:
    # Lazy, so `kvxfer.integrations.vllm.checkpoint` and the settings import without vLLM.
    if name == "KvxferConnector":
        from .connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(name)
