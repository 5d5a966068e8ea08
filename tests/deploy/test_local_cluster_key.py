"""`kvxfer up`'s cluster key (kvxfer.cluster.local_cluster): made readable by its owner only,
and gone when the cluster stops, while the logs stay."""

from __future__ import annotations

import stat
from pathlib import Path

from kvxfer.cluster.local_cluster import LocalCluster


def test_the_clusters_own_key_is_owner_only_and_removed_at_stop_logs_kept(tmp_path: Path) -> None:
    cluster = LocalCluster(prefill=1, decode=1, log_dir=str(tmp_path))
    key = cluster.key_path
    assert key is not None and key.exists()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    (tmp_path / "router.log").write_text("kept\n")  # stands in for the processes' logs
    cluster.stop()  # nothing was started: stop() still ends what the cluster made
    assert not key.exists(), "the cluster key outlived its cluster"
    assert (tmp_path / "router.log").read_text() == "kept\n"


def test_a_key_the_caller_names_is_left_alone(tmp_path: Path) -> None:
    theirs = tmp_path / "operator.key"
    theirs.write_text("not ours to delete\n")
    cluster = LocalCluster(prefill=1, decode=1, log_dir=str(tmp_path / "logs"),
                           worker_env={"KVXFER_CLUSTER_KEY_FILE": str(theirs)},
                           router_env={"KVXFER_ROUTER_CLUSTER_KEY_FILE": str(theirs)})
    assert cluster.key_path == theirs
    cluster.stop()
    assert theirs.exists()
