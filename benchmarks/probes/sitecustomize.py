"""The kill drill's block probe (benchmarks/bench_vllm_connectors.py): put on a vLLM
instance's PYTHONPATH, it records every moment the scheduler's block pool takes blocks
back, in the process that owns the pool (the EngineCore), whatever the connector.

Active only with KVXFER_BENCH_BLOCK_PROBE=<file>; without it nothing is patched. Either
way, a sitecustomize this one shadows (later on sys.path) still runs. Each line appended:
"free <CLOCK_MONOTONIC s> <pid> <pool id> <free blocks before> <free blocks after> <idle
free count>", where the idle free count is the pool's blocks less vLLM's null block (usage
0); and one
"patched <CLOCK_MONOTONIC s> <pid>" line per process that patched vLLM's BlockPool, so the
drill tells a probe that never loaded from one that saw nothing freed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from types import ModuleType
from typing import Any

PROBE_ENV = "KVXFER_BENCH_BLOCK_PROBE"
POOL_MODULE = "vllm.v1.core.block_pool"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _append(path: str, line: str) -> None:
    # One O_APPEND write per line: whole lines from several processes, nothing buffered
    # that a killed process could lose.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _now() -> float:
    # The drill stamps its kill with the same system-wide clock.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def patch_block_pool(module: ModuleType, path: str) -> None:
    """Wraps BlockPool.free_blocks and unpin_blocks (both return blocks to the free queue)
    so that each call appends the pool's free count after it."""
    pool_cls = module.BlockPool
    for name in ("free_blocks", "unpin_blocks"):
        original = getattr(pool_cls, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def recorded(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            # The count before the call too: allocations in between are not recorded, so
            # only this call's own before and after say whether it returned blocks.
            before = self.get_num_free_blocks()
            result = _original(self, *args, **kwargs)
            try:
                _append(path, f"free {_now():.6f} {os.getpid()} {id(self)} {before} {self.get_num_free_blocks()} "
                              f"{self.num_gpu_blocks - 1}\n")
            except OSError:
                pass  # a probe must never break the instance it watches
            return result

        setattr(pool_cls, name, recorded)
    _append(path, f"patched {_now():.6f} {os.getpid()}\n")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's block pool module right after it is first executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != POOL_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real module, once
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch_block_pool(module, self.path)

        loader.exec_module = exec_module
        return spec


def _run_shadowed_sitecustomize() -> None:
    # A sitecustomize later on sys.path (a venv's, the distribution's) would have run had
    # this directory not come first.
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(PROBE_ENV):
    sys.meta_path.insert(0, _PatchOnImport(os.environ[PROBE_ENV]))
_run_shadowed_sitecustomize()
