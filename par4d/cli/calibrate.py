"""``par4d calibrate``: measure this machine's matmul peak, GEMMs by shape, memory bandwidth and collective costs,
print them, and write the machine profile that ``par4d plan --machine`` and ``par4d train --grid auto --machine``
read."""

from __future__ import annotations

import argparse
from pathlib import Path

from par4d.cli.files import check_new_file
from par4d.cli.values import count
from par4d.train.config import DEFAULT_NPROC


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure this machine; write a machine profile for plan")
    p.add_argument("--nproc", type=count(1), default=DEFAULT_NPROC, help="local ranks to measure with")
    p.add_argument("--out", default="profiles/local.toml",
                   help="where to write the TOML profile (default profiles/local.toml; an existing file is "
                        "refused unless --force)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--repeats", type=count(1), default=5)
    p.add_argument("--nodes", type=int, default=None,
                   help="measure an emulated cluster of this many nodes (--nproc ranks per node; needs root)")
    p.add_argument("--link", default=None, help="emulated inter-node link rate (with --nodes; default 1gbit)")


def run(args: argparse.Namespace) -> int:
    if args.link is not None and args.nodes is None:   # else it would be silently unused
        raise ValueError(f"--link {args.link}: the link between emulated nodes; give --nodes too")
    check_new_file(args.out, "--out", args.force)     # before the matmul peak and the ranks
    from par4d.measure.calibrate import calibrate

    cluster = None
    if args.nodes is not None:
        from par4d.launch.cluster import ClusterSpec

        cluster = ClusterSpec(args.nodes, args.nproc, args.link or "1gbit")
    result = calibrate(args.nproc, Path(args.out), args.repeats, cluster)
    machine = result["machine"]
    print(f"matmul peak {result['peak_total'] / 1e9:.1f} GFLOP/s fp32 (whole machine; "
          f"{machine.peak_flops / 1e9:.1f} per rank of {result['world']})")
    gemm = result["gemm"]
    print(f"GEMMs by shape ({gemm['points']} shapes, one rank's threads, ranks sharing the cores): "
          f"{gemm['efficiency']:.2f} of a rank's peak at the largest, {gemm['kernel_latency'] * 1e6:.1f} us per GEMM, "
          f"memory {gemm['memory_bandwidth'] / 1e9:.1f} GB/s; median error of the fit {gemm['median_error']:.0%}; "
          f"attention (fused, forward and backward) {gemm['attention_efficiency']:.2f} of a rank's peak")
    host = result["host"]
    print(f"host work of a training step: {host['microbatch_seconds'] * 1e3:.2f} ms a microbatch of the bench GPT "
          f"alone (2-token sequences, 1 against 4 microbatches); beyond what its GEMMs cost, with the cores shared: "
          f"{host['layer_overhead'] * 1e6:.1f} us per layer pass (the profile's layer_overhead)")
    across = any("alpha_inter" in f for f in result["fits"].values())
    print(f"{'collective':<15} {'alpha (us)':>10} {'beta (GB/s)':>11} "
          + (f"{'across: alpha':>13} {'beta':>7} " if across else "")
          + f"{'error':>6} {'CPU busy':>8}   c1 log2 p + c2 m + c3")
    for kind, f in result["fits"].items():
        tail = (f"c1={f['c1'] * 1e3:.3f} ms, c2={f['c2'] * 1e9:.3f} s/GB, c3={f['c3'] * 1e3:.3f} ms" if "c1" in f
                else "(one group size: not fitted)")
        inter = f"{f['alpha_inter'] * 1e6:>13.1f} {f['beta_inter'] / 1e9:>7.3f} " if across else ""
        print(f"{kind:<15} {f['alpha'] * 1e6:>10.1f} {f['beta'] / 1e9:>11.3f} {inter}{f['median_error']:>6.0%} "
              f"{f.get('cpu', float('nan')):>8.0%}   {tail}")
    print("alpha: seconds per ring step (latency), beta: bytes/s, both fitted over every group and message size; "
          "error: the fit's median; CPU busy: the share of a collective's time the ranks' CPU worked (gloo's "
          "copies and sums, which take the cores compute needs), the rest waiting")
    sync = result["sync"]
    print(f"a collective between compute, as training issues them: {sync['sync_seconds'] * 1e6:.0f} us beyond the "
          f"compute ({sync['compute_seconds'] * 1e3:.2f} ms) and the collective alone "
          f"({sync['collective_seconds'] * 1e3:.2f} ms), all {sync['p']} ranks: the profile's sync_cost, paid per "
          f"collective and never hidden (the ranks reach each one at different moments)")
    print(f"profile written to {args.out}")
    return 0
