"""`kvxfer up`'s KV memory plan (kvxfer.cluster.kv_memory_plan): pages sized to the machine's
free memory, or a refusal before any process starts that says how much memory the layout needs.

The issue it answers: `kvxfer up --model llama3-8b-kv --prefill 1 --decode 2` on a 24 GiB
machine mapped 3 x 2,048 pages of 4 MiB (24 GiB) and the OOM killer took a worker. The
sizing is checked with a given MemAvailable (no test allocates gigabytes); the refusal
with the real command; a real start with a small budget is in test_local_etcd_auth.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.cluster.kv_memory_plan import (
    DEFAULT_MAX_PAGES_PER_WORKER,
    KvMemoryBudgetError,
    model_weight_bytes,
    plan_kv_pages,
    read_mem_available_bytes,
    worker_process_bytes,
)
from kvxfer.model.config import ModelConfig
from kvxfer.model.transformer import Transformer

GiB = 1 << 30
MiB = 1 << 20
LLAMA = ModelConfig.preset("llama3-8b-kv")
# What a 24 GiB machine with nothing else running reports (this one: 22.5 GiB of 23.4).
MEM_AVAILABLE_24_GIB_MACHINE = int(22.5 * GiB)


def test_llama3_8b_kv_1p_2d_on_a_24_gib_machine_starts_with_pages_that_fit() -> None:
    plan = plan_kv_pages(LLAMA, 3, mem_available_bytes=MEM_AVAILABLE_24_GIB_MACHINE)
    assert plan.page_bytes == 4 * MiB
    assert 256 <= plan.pages_per_worker < DEFAULT_MAX_PAGES_PER_WORKER
    # KV, the three workers' own memory and the router's and etcd's fit with room to spare.
    total = plan.kv_bytes + 3 * worker_process_bytes(LLAMA)
    assert total < MEM_AVAILABLE_24_GIB_MACHINE * 0.9


def test_the_old_2048_pages_are_refused_up_front_with_the_memory_they_need() -> None:
    with pytest.raises(KvMemoryBudgetError) as refused:
        plan_kv_pages(LLAMA, 3, mem_available_bytes=MEM_AVAILABLE_24_GIB_MACHINE, num_pages=2048)
    message = str(refused.value)
    assert "3 workers x 2048 pages x 4 MiB" in message and "need 24.00 GiB" in message
    assert "MemAvailable of " in message and "lower --num-pages to at most" in message


def test_a_machine_too_small_for_one_request_per_worker_is_refused() -> None:
    with pytest.raises(KvMemoryBudgetError, match=r"room for one request of 4096 tokens each\) need 3.00 GiB"):
        plan_kv_pages(LLAMA, 3, mem_available_bytes=4 * GiB)


def test_a_budget_caps_the_pages_and_the_tiny_model_keeps_its_default() -> None:
    plan = plan_kv_pages(LLAMA, 3, mem_available_bytes=MEM_AVAILABLE_24_GIB_MACHINE, kv_memory_budget_bytes=3 * GiB)
    assert plan.pages_per_worker == 256 and plan.kv_bytes == 3 * GiB
    tiny = plan_kv_pages(ModelConfig.preset("tiny"), 4, mem_available_bytes=4 * GiB)
    assert tiny.pages_per_worker == DEFAULT_MAX_PAGES_PER_WORKER


def test_the_weight_estimate_matches_the_model_the_worker_builds() -> None:
    # The plan counts a worker's weights from the config; a model change must show here.
    tiny = ModelConfig.preset("tiny")
    model = Transformer(tiny)
    rope = 2 * tiny.max_context * (tiny.head_dim // 2)
    assert model_weight_bytes(tiny) == (model.num_parameters() + rope) * tiny.dtype_size


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   23592960 kB\n")
    assert read_mem_available_bytes(meminfo) == 23592960 * 1024
    assert read_mem_available_bytes() > 0


def test_kvxfer_up_refuses_before_starting_anything(tmp_path: Path) -> None:
    log_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "up", "--model", "llama3-8b-kv", "--prefill", "1", "--decode", "2",
         "--kv-memory-budget-gib", "1", "--log-dir", str(log_dir)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the KV caches do not fit: 3 workers x 256 pages x 4 MiB of llama3-8b-kv KV" in done.stdout
    assert "need 3.00 GiB" in done.stdout and "--kv-memory-budget-gib allows 1 GiB" in done.stdout
    # Nothing started: no etcd, no worker, no router wrote a log; no key or certificate left.
    assert sorted(p.name for p in log_dir.iterdir()) == []
