"""Functions run on emulated-cluster ranks (imported by module path there)."""

import torch
import torch.distributed as dist


def allreduce_sum():
    import os

    import par4d

    grid = par4d.init(x=int(os.environ["LOCAL_WORLD_SIZE"]), data=int(os.environ["PAR4D_CLUSTER_NODES"]))
    t = torch.tensor([float(grid.rank)])
    dist.all_reduce(t)
    addresses = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, os.environ.get("GLOO_SOCKET_IFNAME"))
    return {"sum": t.item(), "world": dist.get_world_size(), "ifnames": addresses, "grid": grid.sizes}


def fail_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise SystemExit(3)
    return "ok"


def fail_on_rank_1_in_a_collective():
    import os

    dist.init_process_group("gloo", init_method="env://")
    if os.environ["RANK"] == "1":
        raise SystemExit(3)
    dist.all_reduce(torch.ones(1))     # rank 0 waits here for a peer that is gone
    return "unreachable"


def staged_all_reduce():
    """data=4 over 2 emulated nodes of 2: the nodes found from the namespaces, the data group staged."""
    import os

    import par4d
    from par4d import comm

    grid = par4d.init(data=int(os.environ["WORLD_SIZE"]), hierarchical="on")
    t = torch.arange(300_001, dtype=torch.float64) * (grid.rank + 1)     # whole numbers: any order, same bits
    with grid.ledger.capture() as entries:
        comm.all_reduce(grid, t, "data")
    expected = torch.arange(300_001, dtype=torch.float64) * sum(r + 1 for r in range(grid.world_size))
    result = {"nodes": grid.nodes, "staged": grid.staged_axes(), "exact": torch.equal(t, expected),
              "stages": [(e.kind, e.stage) for e in entries]}
    grid.close()
    return result
