"""The grid: the rank layout of docs/architecture.md, process groups, launcher environments."""

import itertools
import os

import torch
import torch.distributed as dist

from par4d.grid import AXES, coords_of, rank_of
from par4d.launch import distributed_env
from par4d.launch.local import ALLOCATOR, allocator_settings
from tests import cases


def test_rank_layout_matches_design_formula():
    sizes = dict(x=2, y=3, z=2, context=2, data=2, pipe=2)
    for pipe, data, context, z, y, x in itertools.product(*(range(sizes[a]) for a in reversed(AXES))):
        rank = ((((pipe * sizes["data"] + data) * sizes["context"] + context) * sizes["z"] + z) * sizes["y"] + y) \
            * sizes["x"] + x
        coords = dict(x=x, y=y, z=z, context=context, data=data, pipe=pipe)
        assert rank_of(coords, sizes) == rank
        assert coords_of(rank, sizes) == coords
    # Without a context axis (size 1: not in a grid's sizes), every rank's place is what it was
    del sizes["context"]
    for pipe, data, z, y, x in itertools.product(*(range(sizes[a]) for a in ("pipe", "data", "z", "y", "x"))):
        rank = (((pipe * sizes["data"] + data) * sizes["z"] + z) * sizes["y"] + y) * sizes["x"] + x
        assert coords_of(rank, sizes) == dict(x=x, y=y, z=z, context=0, data=data, pipe=pipe)


def _group_members(sizes: dict) -> dict:
    grid = cases.grid(**sizes)
    out = {}
    for axes in [(a,) for a in AXES] + [("z", "data"), ("x", "y", "z")]:
        group = grid.group(*axes)
        mine = torch.tensor([grid.rank])
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        out[axes] = ([int(t) for t in gathered], grid.group_ranks(*axes))
    out["coords"] = {a: grid.coord(a) for a in AXES}
    return out


def test_groups_hold_the_ranks_that_differ_only_along_their_axes(pool8):
    sizes = dict(x=2, y=1, z=2, data=2)
    for rank, result in enumerate(pool8.run(_group_members, sizes)):
        full = dict(sizes, pipe=1)
        assert result.pop("coords") == coords_of(rank, full)
        for axes, (members, claimed) in result.items():
            expected = sorted(r for r in range(8)
                              if all(coords_of(r, full)[a] == coords_of(rank, full)[a] for a in AXES if a not in axes))
            assert members == expected == claimed, (rank, axes)


def test_launcher_environments():
    assert distributed_env({}) is None
    torchrun = distributed_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
                                "MASTER_PORT": "1234"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.master_addr,
            torchrun.master_port, torchrun.launcher) == (3, 4, 1, "n1", 1234, "torchrun")
    srun = distributed_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                            "MASTER_ADDR": "head", "MASTER_PORT": "2000", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"})
    assert (srun.rank, srun.world_size, srun.local_rank, srun.local_world_size, srun.master_addr,
            srun.master_port, srun.launcher) == (5, 8, 1, 4, "head", 2000, "srun")
    # Without MASTER_PORT, the port follows the job id (two jobs on a node differ).
    job = distributed_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "MASTER_ADDR": "h",
                           "SLURM_JOB_ID": "123457"})
    assert job.master_port == 20000 + 123457 % 20000
    # An salloc shell (no job step) is not a job: par4d launches its own ranks there.
    assert distributed_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None


def _mismatched_init():
    import par4d

    rank = dist.get_rank()
    return par4d.init(x=2, y=2) if rank == 0 else par4d.init(x=4)


def test_ranks_asking_for_different_grids(pool4):
    for message in pool4.errors(_mismatched_init, timeout=30):
        assert "different grids" in message and "ranks [0]: x=2 y=2" in message and "ranks [1, 2, 3]: x=4" in message


def _grids_one_after_another():
    """Close a grid, build another on the same job, leave the job, join it again."""
    import pytest

    import par4d
    from par4d import comm

    first = par4d.init(z=2, data=2)
    summed = comm.all_reduce(first, torch.ones(3), "z", "data")
    gathered = comm.all_gather(first, torch.full((1,), float(first.coord("z"))), "z")
    groups = [first.group("z"), first.group("z", "data")]
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.group("z")
    for group in groups:                                   # destroyed, not just forgotten
        with pytest.raises(ValueError):
            dist.get_rank(group)
    whole = par4d.init(x=4)                                # x spans the world: the default group
    whole.close()
    dist.barrier()                                         # the default group survived
    second = par4d.init(x=2, data=2)                       # same job, fresh groups
    over_x = comm.all_reduce(second, torch.full((1,), float(dist.get_rank())), "x")
    dist.destroy_process_group()
    second.close()                                         # groups already gone with the job: no error
    third = par4d.init(y=2, z=2)                           # joins the launcher's job again
    over_yz = comm.all_reduce(third, torch.full((1,), float(dist.get_rank())), "x", "y", "z")
    dist.destroy_process_group()
    return summed.tolist(), gathered.tolist(), over_x.item(), over_yz.item()


def test_grids_closed_and_jobs_joined_again():
    """Through the launcher's env:// store: a second join meets its own peers, never the first
    join's stale ones (torch restarts group numbering on destroy_process_group)."""
    from par4d.launch import launch_local

    results = launch_local(4, _grids_one_after_another, ())
    for rank, (summed, gathered, over_x, over_yz) in results.items():
        assert summed == [4.0, 4.0, 4.0] and gathered == [0.0, 1.0]
        assert over_x == {0: 1, 1: 1, 2: 5, 3: 5}[rank]        # x pairs: (0, 1), (2, 3)
        assert over_yz == 6                                     # x, y, z span all four ranks


def _world_gloo_interface_and_allocator():
    import par4d

    grid = par4d.init(data=2)
    try:
        return dist.get_world_size(), os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("MALLOC_TRIM_THRESHOLD_")
    finally:
        grid.close()
        dist.destroy_process_group()


def test_local_ranks_start_where_the_hostname_does_not_resolve():
    """launch_local's ranks meet at 127.0.0.1 and gloo binds the loopback interface. Left to itself, torch's
    agent hands the ranks this machine's hostname, and where that does not resolve (a container, a cloud GPU
    box) they retry it until their 300 s store timeout and fail. Run under a hostname of its own, in a UTS
    namespace (root only: skipped elsewhere); the launcher's own environment is left as it was. The ranks also
    get glibc malloc's thresholds (par4d.launch.local.ALLOCATOR)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode:
        pytest.skip("needs a UTS namespace of its own (unshare --uts, as root)")
    script = ("import os; from par4d.launch import launch_local; "
              "from tests.test_grid import _world_gloo_interface_and_allocator as ranks; "
              "print(sorted(launch_local(2, ranks, ()).values()), os.environ.get('GLOO_SOCKET_IFNAME'))")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", *ALLOCATOR)}
    done = subprocess.run(["unshare", "--uts", "sh", "-c", 'hostname par4d-no-such-host && exec "$0" -c "$1"',
                           sys.executable, script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    trim = ALLOCATOR["MALLOC_TRIM_THRESHOLD_"]
    assert done.stdout.strip().splitlines()[-1] == f"[(2, 'lo', '{trim}'), (2, 'lo', '{trim}')] None"   # Linux: lo


def test_the_users_allocator_settings_are_left_alone():
    assert allocator_settings({}) == ALLOCATOR
    assert allocator_settings({"MALLOC_MMAP_THRESHOLD_": "65536"}) == {}    # theirs, alone: none of ours added
