"""How many KV pages each worker of `kvxfer up` gets, decided before any process starts.

Every builtin worker maps its whole KV cache at start (`num_pages` pages of every layer,
locked where it may be). Three llama3-8b-kv workers at 2,048 pages want 24 GiB of KV: on a
24 GiB machine the kernel's OOM killer then ends one of them, seen only as an exit code.
`plan_kv_pages` sizes the pages to the memory the machine has free (MemAvailable), or to a
budget the operator gives, and refuses up front, with the memory the layout needs, when
even a small cache does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvxfer.errors import KvxferError

if TYPE_CHECKING:  # the model package imports torch; this module only reads a config's fields
    from kvxfer.model.config import ModelConfig

__all__ = [
    "DEFAULT_MAX_PAGES_PER_WORKER",
    "KvMemoryBudgetError",
    "KvMemoryPlan",
    "model_weight_bytes",
    "plan_kv_pages",
    "read_mem_available_bytes",
    "worker_process_bytes",
]

GiB = 1 << 30
MiB = 1 << 20
#: Pages per worker when neither --num-pages nor a small budget says less: one whole
#: llama3-8b-kv context (32,768 tokens), 16 MiB of the tiny model.
DEFAULT_MAX_PAGES_PER_WORKER = 2048
# Fewer pages than one request of this many tokens makes a worker that refuses ordinary
# requests: 4,096 is the router's default prompt limit plus its default max_tokens limit
# (2,048 each).
_MIN_REQUEST_TOKENS = 4096
# A worker's memory besides its KV pages and weights: interpreter, torch, engine, HTTP
# server, activations. Measured: 280 MiB resident for a tiny worker (weights negligible).
_WORKER_BASE_BYTES = 384 * MiB
# Weights are allocated through float32 temporaries: measured, a llama3-8b-kv worker held
# 843 MiB besides its KV for 464 MiB of weights and rotary tables, i.e. 1.2x plus the base.
_WEIGHT_OVERHEAD_FACTOR = 1.25
# The router (90 MiB measured), etcd (25 MiB) and `kvxfer up` itself, which imports torch
# to read the model's shape (250 MiB).
_CLUSTER_PROCESSES_BYTES = 512 * MiB
# Share of MemAvailable left to everything else: long prefills' attention scores, the
# page cache, the rest of the machine.
_HEADROOM_FRACTION = 0.10


class KvMemoryBudgetError(KvxferError, ValueError):
    """The workers' KV caches do not fit the memory budget; the message says how much the
    layout needs, how much there is, and which flag changes it."""


@dataclass(frozen=True)
class KvMemoryPlan:
    """The pages each worker gets and the memory figures they were chosen from."""

    pages_per_worker: int
    workers: int
    page_bytes: int  # one page of every layer
    kv_budget_bytes: int  # what all workers' KV caches may take together
    mem_available_bytes: int

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV all workers map together."""
        return self.pages_per_worker * self.workers * self.page_bytes

    def describe(self) -> str:
        """One line for the operator: pages, their memory and the budget."""
        return (f"KV cache {self.workers} workers x {self.pages_per_worker} pages x "
                f"{self.page_bytes / MiB:.3g} MiB = {self.kv_bytes / GiB:.2f} GiB (budget "
                f"{self.kv_budget_bytes / GiB:.2f} GiB; MemAvailable {self.mem_available_bytes / GiB:.2f} GiB)")


def read_mem_available_bytes(meminfo_path: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable from `meminfo_path`: memory the kernel can give without swapping."""
    for line in meminfo_path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                break
            return int(value) * 1024
    raise KvMemoryBudgetError(f"no MemAvailable line in kB in {meminfo_path}; give --kv-memory-budget-gib")


def model_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the tensors a worker's model holds: the weights and rotary tables
    kvxfer.model.transformer.Transformer builds (counted here from the config, without
    torch; tests/deploy/test_up_memory_budget.py checks the two agree)."""
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = 2 * hidden + (q_dim + 2 * kv_dim) * hidden + hidden * q_dim + 3 * inter * hidden
    elements = 2 * config.vocab_size * hidden + hidden + config.num_layers * per_layer
    rope = 2 * config.max_context * (config.head_dim // 2)
    return (elements + rope) * config.dtype_size


def worker_process_bytes(config: ModelConfig) -> int:
    """Estimated memory of one worker besides its KV pages: base process plus weights."""
    return _WORKER_BASE_BYTES + math.ceil(model_weight_bytes(config) * _WEIGHT_OVERHEAD_FACTOR)


def plan_kv_pages(
    config: ModelConfig,
    workers: int,
    *,
    mem_available_bytes: int,
    num_pages: int | None = None,
    kv_memory_budget_bytes: int | None = None,
) -> KvMemoryPlan:
    """Pages per worker for `workers` workers of `config` on a machine with
    `mem_available_bytes` free, or `KvMemoryBudgetError` before anything starts.

    The KV budget is what is left of MemAvailable after a tenth of it, the workers'
    processes (weights included) and the router and etcd; a `kv_memory_budget_bytes` lowers
    it further. Given `num_pages`, all workers' pages must fit that budget. Otherwise each
    worker gets as many pages as fit, at most `DEFAULT_MAX_PAGES_PER_WORKER`, and at least
    room for one request of 4,096 tokens (or the whole context, if shorter).
    """
    if workers < 1:
        raise KvMemoryBudgetError(f"a cluster needs at least one worker, got {workers}")
    if num_pages is not None and num_pages < 1:
        raise KvMemoryBudgetError(f"--num-pages must be at least 1, got {num_pages}")
    if kv_memory_budget_bytes is not None and kv_memory_budget_bytes <= 0:
        raise KvMemoryBudgetError("--kv-memory-budget-gib must be positive")
    page_bytes = config.page_bytes * config.num_layers
    processes_bytes = workers * worker_process_bytes(config) + _CLUSTER_PROCESSES_BYTES
    machine_kv_bytes = int(mem_available_bytes * (1 - _HEADROOM_FRACTION)) - processes_bytes
    budget = machine_kv_bytes if kv_memory_budget_bytes is None else min(kv_memory_budget_bytes, machine_kv_bytes)
    fitting_pages = max(0, budget // (workers * page_bytes))
    min_pages = math.ceil(min(_MIN_REQUEST_TOKENS, config.max_context) / config.block_size)
    wanted = num_pages if num_pages is not None else min_pages
    if fitting_pages < wanted:
        needed = workers * wanted * page_bytes
        what = f"{workers} workers x {wanted} pages x {page_bytes / MiB:.3g} MiB of {config.name} KV"
        if num_pages is None:
            what += f" (the least: room for one request of {min_pages * config.block_size} tokens each)"
        by_budget = kv_memory_budget_bytes is not None and kv_memory_budget_bytes < machine_kv_bytes
        if by_budget:
            limit = f"--kv-memory-budget-gib allows {budget / GiB:.3g} GiB"
            hints = [f"raise --kv-memory-budget-gib to {math.ceil(needed / GiB * 100) / 100:.2f}"]
        else:
            needed_available = (needed + processes_bytes) / (1 - _HEADROOM_FRACTION)
            limit = (f"this machine has {max(machine_kv_bytes, 0) / GiB:.2f} GiB for KV (MemAvailable "
                     f"{mem_available_bytes / GiB:.2f} GiB less {_HEADROOM_FRACTION:.0%} headroom and "
                     f"{processes_bytes / GiB:.2f} GiB for the processes, weights included); this layout needs "
                     f"MemAvailable of {needed_available / GiB:.2f} GiB")
            hints = ["free memory"]
        if num_pages is not None and fitting_pages > 0:
            hints.insert(0, f"lower --num-pages to at most {fitting_pages}")
        hints.append("run fewer workers")
        raise KvMemoryBudgetError(f"the KV caches do not fit: {what} need {needed / GiB:.2f} GiB, but {limit}. "
                                  f"To start: {', '.join(hints[:-1])} or {hints[-1]}.")
    pages = num_pages if num_pages is not None else min(DEFAULT_MAX_PAGES_PER_WORKER, fitting_pages)
    return KvMemoryPlan(pages_per_worker=pages, workers=workers, page_bytes=page_bytes,
                        kv_budget_bytes=budget, mem_available_bytes=mem_available_bytes)
