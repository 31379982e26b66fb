"""The emulated cluster: jobs across network namespaces, and cleanup in every case."""

import subprocess
import sys

import pytest

from par4d.launch.cluster import ClusterSpec, EmulatedCluster, launch_cluster, leftover_namespaces, unavailable_reason
from tests import cluster_cases

needs_root = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_spec_validation():
    with pytest.raises(ValueError, match="--nodes and ranks per node must be >= 1"):
        ClusterSpec(0, 2)
    with pytest.raises(ValueError, match="--link 'fast': give a rate like 1gbit"):
        ClusterSpec(2, 1, "fast")
    assert ClusterSpec(3, 2, "500mbit").world_size == 6


@needs_root
def test_job_across_two_nodes_and_cleanup():
    result = launch_cluster(ClusterSpec(2, 2, "1gbit"), cluster_cases.allreduce_sum, ())[0]
    assert result["sum"] == 0 + 1 + 2 + 3 and result["world"] == 4
    assert result["ifnames"] == ["eth0"] * 4
    assert result["grid"]["x"] == 2 and result["grid"]["data"] == 2
    assert leftover_namespaces(include_live=True) == []


@needs_root
def test_nodes_found_and_collectives_staged_across_them():
    result = launch_cluster(ClusterSpec(2, 2, "1gbit"), cluster_cases.staged_all_reduce, ())[0]
    assert result["nodes"] == (0, 0, 1, 1)          # two namespaces, two ranks in each
    assert ("data",) in result["staged"]
    assert result["exact"]
    assert result["stages"] == [("reduce_scatter", "node"), ("all_reduce", "link"), ("all_gather", "node")]
    assert leftover_namespaces(include_live=True) == []


@needs_root
def test_cleanup_when_a_rank_fails():
    with pytest.raises(RuntimeError, match=r"ranks \[1\] failed"):
        with EmulatedCluster(ClusterSpec(2, 1, "1gbit")) as cluster:
            assert len(leftover_namespaces(include_live=True)) == 3        # two nodes and the switch
            cluster.launch(cluster_cases.fail_on_rank_1, ())
    assert leftover_namespaces(include_live=True) == []


@needs_root
def test_cleanup_when_interrupted(tmp_path):
    """SIGTERM while the cluster is up (a CI timeout, Ctrl-C) still removes it."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(cluster_cases.__file__.rsplit('/tests/', 1)[0])!r})\n"
        "from par4d.launch.cluster import ClusterSpec, EmulatedCluster\n"
        "with EmulatedCluster(ClusterSpec(2, 1)):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    assert len(leftover_namespaces(include_live=True)) == 3
    proc.terminate()
    proc.wait(timeout=30)
    assert leftover_namespaces(include_live=True) == []


@needs_root
def test_a_failed_rank_stops_the_others():
    """Rank 1 exits while rank 0 waits in an all-reduce: the job fails at once instead of
    waiting out gloo's timeout (10 minutes); the time limit is a hang detector."""
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] failed"):
        launch_cluster(ClusterSpec(2, 1, "1gbit"), cluster_cases.fail_on_rank_1_in_a_collective, ())
    assert time.monotonic() - start < 120
    assert leftover_namespaces(include_live=True) == []
