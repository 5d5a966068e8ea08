"""The kill drill's decoder-free figures (benchmarks/decoder_free_figures.py) and its block
probe (benchmarks/probes/sitecustomize.py): when the scheduler had its blocks back, a
probe that never loaded shown as '-' with its reason, the probe a no-op without its
variable and chaining to the sitecustomize it shadows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from decoder_free_figures import free_cell, gauge_cell, ratio_line, scheduler_free_after  # noqa: E402

#: A pool of 100 blocks (99 usable): idle before the fault at 10.0, 40 blocks held, 8
#: returned at 10.02, then a call that returns nothing, the rest at 10.05.
LOG = """patched 1.000000 7
free 5.000000 7 140 98 99 99
free 10.020000 7 140 59 67 99
free 10.030000 7 140 67 67 99
free 10.050000 7 140 67 99 99
free 10.060000 7 140 99 99 99
"""


def test_scheduler_free_is_the_first_return_to_idle_after_the_fault() -> None:
    got = scheduler_free_after(LOG, since=10.0, deadline_s=60)
    assert got["free_s"] == pytest.approx(0.05)
    assert got["reason"] is None


def test_blocks_taken_between_two_frees_and_returned_in_one_call_are_the_free() -> None:
    # Allocations are not recorded: the pool was idle after the last free before the
    # fault, the request took 32 blocks unseen, and one call returned them all.
    log = "patched 1.0 7\nfree 5.0 7 140 98 99 99\nfree 10.04 7 140 67 99 99\n"
    assert scheduler_free_after(log, since=10.0, deadline_s=60)["free_s"] == pytest.approx(0.04)


def test_a_call_that_returns_no_blocks_is_not_the_free() -> None:
    # At idle already before the fault: the empty free at 10.06 is not the request's.
    log = "patched 1.0 7\nfree 5.0 7 140 98 99 99\nfree 10.06 7 140 99 99 99\n"
    got = scheduler_free_after(log, since=10.0, deadline_s=60)
    assert got["free_s"] is None
    assert got["reason"] == "pool not back at idle within 60 s (1 frees recorded after the fault)"


def test_a_probe_that_never_loaded_gives_no_figure_but_its_reason() -> None:
    for text in (None, "", "free 10.05 7 140 67 99 99\n"):
        got = scheduler_free_after(text, since=10.0, deadline_s=60)
        assert got == {"free_s": None, "reason": "probe not loaded in the decoder's EngineCore"}
    # Loaded by the API server only: patched, never a free.
    got = scheduler_free_after("patched 1.0 7\n", since=10.0, deadline_s=60)
    assert got == {"free_s": None, "reason": "probe recorded no free: not loaded in the decoder's EngineCore"}
    assert free_cell(None, "probe not loaded in the decoder's EngineCore") == \
        "- (probe not loaded in the decoder's EngineCore)"
    assert free_cell(0.0184, None) == "0.018"


def test_a_free_past_the_deadline_is_no_figure() -> None:
    got = scheduler_free_after(LOG, since=10.0, deadline_s=0.04)
    assert got["free_s"] is None


def test_gauge_cell_and_both_ratio_lines() -> None:
    assert gauge_cell(0.0402, 12.4, 60) == "0.040 (gap 12 ms)"
    assert gauge_cell(None, None, 60) == "> 60"
    assert ratio_line("kvxfer fabric", "scheduler", 0.018, [0.5, None], 60) == (
        "kvxfer fabric: decoder blocks free (scheduler) 0.018 s after a killed prefiller vs best peer 0.500 s: "
        "0.036x (goal < 0.1x) -> met")
    assert ratio_line("kvxfer fabric", "scheduler", None, [0.5], 60) is None


def run_with_probe(tmp_path: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A python whose path has the probe first, a stand-in of vLLM's block pool module (the
    real one takes tens of seconds to import) and another sitecustomize behind the probe."""
    pool = tmp_path / "stand_in" / "vllm" / "v1" / "core"
    pool.mkdir(parents=True)
    for d in (pool, pool.parent, pool.parent.parent):
        (d / "__init__.py").write_text("")
    (pool / "block_pool.py").write_text(
        "class BlockPool:\n"
        "    def __init__(self, n):\n        self.num_gpu_blocks, self.free = n, n - 1\n"
        "    def get_num_free_blocks(self):\n        return self.free\n"
        "    def free_blocks(self, blocks):\n        self.free += len(blocks)\n")
    shadowed = tmp_path / "shadowed"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    env = {k: v for k, v in os.environ.items() if k != "KVXFER_BENCH_BLOCK_PROBE"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "probes"), str(shadowed), str(tmp_path / "stand_in")])
    code = ("import os\nfrom vllm.v1.core.block_pool import BlockPool\n"
            "p = BlockPool(10)\np.free = 5\np.free_blocks([1, 2, 3, 4])\n"
            "print(os.environ.get('SHADOWED_RAN'), hasattr(BlockPool.free_blocks, '__wrapped__'))\n")
    return subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                          timeout=60)


def test_probe_records_each_free_and_chains_to_the_shadowed_sitecustomize(tmp_path: Path) -> None:
    log = tmp_path / "blocks.log"
    r = run_with_probe(tmp_path, {"KVXFER_BENCH_BLOCK_PROBE": str(log)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "True"]
    lines = log.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == ["patched", "free"]
    _, t, pid, _, before, after, idle = lines[1].split()
    assert (int(before), int(after), int(idle)) == (5, 9, 9)
    assert int(pid) > 0 and float(t) > 0


def test_probe_is_a_no_op_without_its_variable(tmp_path: Path) -> None:
    r = run_with_probe(tmp_path, {})
    assert r.returncode == 0, r.stderr
    # Nothing patched, and the shadowed sitecustomize still ran.
    assert r.stdout.split() == ["1", "False"]
