"""The worker record a worker publishes in etcd, and where it lives (the key scheme)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WorkerRole = Literal["prefill", "decode"]
WORKER_ROLES: tuple[str, ...] = ("prefill", "decode")
#: What serves a worker's HTTP API: kvxfer's own workers ("kvxfer": /reserve, /prefill,
#: /generate) or a vLLM instance with the kvxfer connector ("vllm": the OpenAI API, the
#: hand-off carried in kv_transfer_params). The router speaks to each in its own way.
WorkerEngine = Literal["kvxfer", "vllm"]


class WorkerRecord(BaseModel):
    """What a worker publishes about itself in etcd (docs/architecture.md).

    Identity and addressing (`worker_id`, `role`, `http_url`, `engine_address` as hex,
    `model`, `kv_layout`) are fixed for the registration; load fields (`free_pages`,
    `queue_depth`, `running`, `draining`) change through `WorkerRegistration.update`.
    `updated_at` is Unix time in seconds, stamped by the registration at each write.
    Unknown fields are ignored when reading, so a router keeps working while workers
    of a newer version add fields.
    """

    model_config = ConfigDict(extra="ignore")

    # No '/' so the id is exactly one key segment.
    worker_id: str = Field(min_length=1, pattern=r"^[^/\s]+$")
    role: WorkerRole
    http_url: str = Field(min_length=1)
    engine_address: str = Field(pattern=r"^(?:[0-9a-fA-F]{2})*$")
    model: str
    # Workers publish the string of kvxfer.kv.cache.format_kv_layout
    # ("L32-H8-D128-float32-bs16"); a prefiller pushes only into decoders whose layout
    # equals its own.
    kv_layout: str
    total_pages: int = Field(ge=0)
    free_pages: int = Field(default=0, ge=0)
    queue_depth: int = Field(default=0, ge=0)
    running: int = Field(default=0, ge=0)
    draining: bool = False
    engine: WorkerEngine = "kvxfer"
    # A vLLM instance's tensor parallel size and its model's KV heads over every rank (0:
    # not said): a router pairs instances of different sizes only where the heads map.
    tp_size: int = Field(default=1, ge=1)
    kv_heads: int = Field(default=0, ge=0)
    # Where a vLLM instance's connector serves /metrics and the load figures of streamed
    # requests (GET /kvxfer/loads/<transfer_id>); empty: not served, or an older instance.
    metrics_url: str = ""
    # A vLLM prefill instance's liveness port, "host:port" (its connections close when the
    # process dies: kvxfer/integrations/vllm/prefiller_liveness.py); empty: none.
    liveness_address: str = Field(default="", max_length=80)
    # The contract names it updated_at; the unit is seconds since the Unix epoch.
    updated_at: float = 0.0


# Fields that place the record under its key; changing them would be a new registration.
IDENTITY_FIELDS = frozenset({"worker_id", "role"})


def workers_prefix(prefix: str) -> str:
    """Return the key prefix under which all worker records live (ends with '/')."""
    return f"{prefix}/workers/"


def worker_key(prefix: str, role: WorkerRole, worker_id: str) -> str:
    """Return the etcd key of one worker: ``{prefix}/workers/{role}/{worker_id}``."""
    return f"{workers_prefix(prefix)}{role}/{worker_id}"
