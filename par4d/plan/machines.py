"""Machine profiles: what the planner knows about the hardware.

Built-ins come from the papers (device counts, peaks, memory) and public hardware
figures (link bandwidths, documented per field). User profiles are TOML files:

    [machine]
    name = "mycluster"
    devices_per_node = 4
    peak_flops = 312e12        # per device, training dtype
    memory_bytes = 40e9        # per device
    beta_intra = 100e9         # bytes/s, peer-to-peer inside a node (one direction)
    beta_inter = 100e9         # bytes/s between two nodes (all NICs of a node)
    latency = 10e-6            # seconds per ring step inside a node (alpha); 0 = the paper's model
    latency_inter = 20e-6      # optional: seconds per ring step that crosses nodes (default: latency)
    efficiency = 0.5           # fraction of peak the largest GEMMs reach (with memory_bandwidth: by shape)
    memory_bandwidth = 1.5e12  # optional: bytes/s of device memory; GEMMs are then timed by their shapes
    kernel_latency = 5e-6      # optional: seconds every GEMM costs beyond its roofline time
    layer_overhead = 30e-6     # optional: host seconds a training step spends per layer pass beyond its kernels
    attention_efficiency = 0.6 # optional: fraction of peak attention's fused matmuls reach (default: efficiency)
    host_bandwidth = 50e9      # optional: bytes/s each way between host memory and a device (PCIe): the
                               #   offloaded optimizer's link (default: its transfers are not timed)
    cores_shared = 1.0         # optional: ranks time-sharing each core (CPU ranks beyond the cores; 1: a device each)
    comm_cpu_share = 0.0       # optional: share of a collective's time the CPU is busy (counts with cores_shared)
    bytes_per_element = 2      # 2 for bf16/fp16 training, 4 for fp32
    all_gather_scale = 1.0     # optional: all-gather / reduce-scatter bandwidth
    reduce_scatter_scale = 1.0 #   relative to all-reduce's (full model only), inside a node
    all_gather_scale_inter = 1.0     # optional: the same across nodes, relative to beta_inter
    reduce_scatter_scale_inter = 1.0 #   (default: the scales inside)
    staged = false             # optional: collectives over groups that span nodes go in stages
                               #   (par4d's gloo path, --hierarchical auto; NCCL's own algorithms: false)

Every value is checked when the profile loads, and the error names the file and the key: numbers are finite and
not booleans (``staged`` is one), counts (devices_per_node, bytes_per_element) are whole, all are > 0 except
latencies (>= 0) and the efficiencies are at most 1; an unknown key in [machine] is an error. Other tables
(calibrate's [fit]) are notes.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    name: str
    devices_per_node: int
    peak_flops: float
    memory_bytes: float
    beta_intra: float
    beta_inter: float
    latency: float = 0.0
    latency_inter: float | None = None   # None: ``latency`` on every step
    efficiency: float = 0.5           # of peak, by the largest GEMMs (par4d/plan/compute.py)
    bytes_per_element: int = 2
    # Bandwidth of all-gather / reduce-scatter relative to all-reduce's (1 for ring
    # implementations that reach the model; gloo on CPU measures well below).
    all_gather_scale: float = 1.0
    reduce_scatter_scale: float = 1.0
    # The same across nodes, relative to beta_inter (gloo's ratios differ there); None: the scales inside.
    all_gather_scale_inter: float | None = None
    reduce_scatter_scale_inter: float | None = None
    staged: bool = False     # par4d stages collectives over groups that span nodes (docs/architecture.md)
    # The compute model by shape (par4d/plan/compute.py); None: FLOPs over peak x efficiency, shapes aside.
    memory_bandwidth: float | None = None    # bytes/s of device memory (GEMMs' roofline, element-wise work)
    kernel_latency: float = 0.0              # seconds per GEMM beyond its roofline time
    # Host seconds per layer pass (a GEMM's forward or backward) in a training step beyond its kernels: the module's
    # Python, autograd and the launches around it. calibrate measures it on CPUs, where it adds to the compute;
    # on a GPU the host runs ahead of the kernels, and the built-ins leave it 0.
    layer_overhead: float = 0.0
    attention_efficiency: float | None = None   # of peak, by attention's fused matmuls (None: efficiency)
    # Ranks time-sharing each core (a CPU machine running more ranks than cores; 1: a device per rank): a rank
    # that waits gives its share to the others, and communication's copies and sums take the cores compute needs.
    cores_shared: float = 1.0
    # The share of a collective's time its ranks' CPU is busy (gloo's copies and sums; calibrate measures it):
    # where ranks time-share the cores that share takes cores the compute needs and never hides.
    comm_cpu_share: float = 0.0
    # Seconds each collective costs beyond its time from a common start: its ranks reach it at different moments
    # (calibrate measures it; where ranks time-share the cores one may be off its core). No overlap hides it.
    sync_cost: float = 0.0
    # Bytes/s each way between host memory and a device (PCIe, pinned copies): an offloaded optimizer streams its
    # masters and moments over it every step (par4d/plan/compute.py). None: those transfers are not timed.
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in OPTIONAL and getattr(self, f.name) is None:
                continue
            problem = _problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"machine {self.name!r}: {problem}")
            if f.name in COUNTS:        # a whole float (4.0) is the count it names
                object.__setattr__(self, f.name, int(getattr(self, f.name)))

    def to_toml(self) -> str:
        lines = ["[machine]"]
        for key, value in asdict(self).items():
            if value is None:      # an optional field left out (TOML has no null)
                continue
            # json's string escapes are TOML's basic-string escapes: a name with quotes still loads
            text = json.dumps(value, ensure_ascii=False) if isinstance(value, (str, bool)) else repr(value)
            lines.append(f"{key} = {text}")     # json's true/false and string escapes are TOML's
        return "\n".join(lines) + "\n"


# Fields that count things: whole numbers >= 1. Every other number is finite and > 0, except these lower bounds.
COUNTS = ("devices_per_node", "bytes_per_element")
# 0 = the paper's model (no per-step latency), no cost per GEMM, no CPU in collectives
AT_LEAST_ZERO = ("latency", "latency_inter", "kernel_latency", "layer_overhead", "comm_cpu_share", "sync_cost")
# None: not given
OPTIONAL = ("latency_inter", "memory_bandwidth", "attention_efficiency", "host_bandwidth", "all_gather_scale_inter",
            "reduce_scatter_scale_inter")
FRACTIONS = ("efficiency", "attention_efficiency", "comm_cpu_share")
BOOLS = ("staged",)


def _problem(key: str, value) -> str | None:
    """What is wrong with ``value`` for the Machine field ``key`` ("key must be ..., got ..."), or None."""
    if key == "name":
        return None if isinstance(value, str) and value else f"name must be a non-empty string, got {value!r}"
    if key in BOOLS:
        return None if isinstance(value, bool) else f"{key} must be true or false, got {value!r}"
    # bool is an int subclass (TOML true would read as 1): refused before the number checks.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key} must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"{key} must be a finite number, got {value!r}"
    if key in COUNTS and value != int(value):
        return f"{key} must be a whole number, got {value!r}"
    if key in AT_LEAST_ZERO:
        if value < 0:
            return f"{key} must be >= 0, got {value!r}"
        return f"{key} is a share, in [0, 1]; got {value!r}" if key in FRACTIONS and value > 1 else None
    if value <= 0:
        return f"{key} must be > 0, got {value!r}"
    if key == "cores_shared" and value < 1:
        return f"cores_shared counts ranks per core, at least 1; got {value!r}"
    if key in FRACTIONS and value > 1:
        return f"{key} is a fraction of peak, in (0, 1]; got {value!r}"
    return None


GB = 1e9
US = 1e-6
# Latencies per ring step: NCCL's own cost model (NVIDIA/nccl, src/graph/tuning.cc, the
# hwLat table for the Ring algorithm and the Simple protocol, which carries large messages):
# 3.4 us a step over NVLink, 9.6 us a step over the network. NCCL adds a base latency per
# collective (8.4 us) that is left out here. A ring step of c bytes then runs at
# c / (α + c / β): half of β at c = α β (340 KB over NVLink, 960 KB over the network at
# 100 GB/s), which is how small messages lose bandwidth in this model.
NCCL_NVLINK_STEP, NCCL_NET_STEP = 3.4 * US, 9.6 * US
# GEMMs by shape (par4d/plan/compute.py), for the machines par4d has not measured (the A100s, the MI250X):
# ``efficiency`` is the largest fraction of the bf16 peak a matmul reached in the Maximum Achievable Matmul
# FLOPS table (stas00/ml-engineering, compute/accelerator/README.md: A100 SXM 267.9 of 312 TFLOP/s, CUDA 12.1;
# MI250X 147.0 of 191.5 for one GCD, ROCm 6.2); ``memory_bandwidth`` is the data sheet's HBM bandwidth.
# ``attention_efficiency``: FlashAttention-2 (Dao, 2023) reports 50-73% of the A100's peak, 0.6 taken; for the
# MI250X no published figure was found and the A100's low end, 0.5, is assumed. The H100 and H200 carry
# par4d's own measurements (below).
A100_MAMF, MI250X_MAMF = 267.9 / 312, 147.0 / 191.5
# Host links (``host_bandwidth``, the offloaded optimizer's), each way: an A100 SXM's PCIe 4.0 x16 on paper, 32 GB/s;
# an MI250X GCD's Infinity Fabric link to the CPU, 36 GB/s (OLCF's Frontier user guide). The H100 and H200 (PCIe
# 5.0 x16, 64 GB/s on paper) carry what par4d measured on an H200's host (``par4d plan device``, 2026-11-26):
# pinned copies of one 16 MiB offload bucket at 49.8 GB/s to the device and 52.2 back, 51 GB/s a step moving both:
# 80% of its paper figure (the A100s' and Frontier's are paper figures, likely as high). Each is one rank's link alone:
# where GPUs share a PCIe switch's uplink (two to a switch on a DGX A100), ranks offloading at once get less.
HOPPER_HOST_LINK = 51 * GB
PCIE4_X16, FRONTIER_HOST_LINK = 32 * GB, 36 * GB
# Perlmutter GPU node: 4 A100-40GB (312 TFLOP/s bf16, HBM2 1,555 GB/s), NVLink 3 between every GPU
# pair (4 links x 25 GB/s per direction = 100 GB/s), 4 Slingshot-11 NICs of 200 Gb/s = 100 GB/s per node.
PERLMUTTER = Machine("perlmutter", devices_per_node=4, peak_flops=312e12, memory_bytes=40 * GB,
                     beta_intra=100 * GB, beta_inter=100 * GB, latency=NCCL_NVLINK_STEP,
                     latency_inter=NCCL_NET_STEP, efficiency=A100_MAMF, bytes_per_element=2,
                     memory_bandwidth=1555 * GB, attention_efficiency=0.6, host_bandwidth=PCIE4_X16)
# DGX A100 (80 GB): 8 A100-80GB SXM (HBM2e 2,039 GB/s), NVSwitch (NVLink 3: 300 GB/s per direction),
# 8 HDR InfiniBand NICs of 200 Gb/s = 200 GB/s per node.
A100_80GB = Machine("a100-80gb", devices_per_node=8, peak_flops=312e12, memory_bytes=80 * GB,
                    beta_intra=300 * GB, beta_inter=200 * GB, latency=NCCL_NVLINK_STEP,
                    latency_inter=NCCL_NET_STEP, efficiency=A100_MAMF, bytes_per_element=2,
                    memory_bandwidth=2039 * GB, attention_efficiency=0.6, host_bandwidth=PCIE4_X16)
# DGX H100: 8 H100 SXM (989 TFLOP/s bf16 dense, HBM3 3,350 GB/s on the data sheet, 80 GB), NVSwitch (NVLink 4:
# 450 GB/s per direction), 8 NDR InfiniBand NICs of 400 Gb/s = 400 GB/s per node. Its compute terms are par4d's
# own measurement of one H100 SXM (``par4d plan device``, torch 2.11 + CUDA 13.0, 2026-11-26; docs/planner.md,
# "On a GPU"): 36 bf16 GEMM shapes fitted at 0.74 of peak and 7.1 us per GEMM (median error 5%; the published
# MAMF search, 0.801, is the best shape's), fused causal attention at 0.50 (cuDNN's; FlashAttention-3's paper
# gives FlashAttention-2 0.35), an element-wise sum at 3,028 GB/s.
H100 = Machine("h100", devices_per_node=8, peak_flops=989e12, memory_bytes=80 * GB,
               beta_intra=450 * GB, beta_inter=400 * GB, latency=NCCL_NVLINK_STEP,
               latency_inter=NCCL_NET_STEP, efficiency=0.74, kernel_latency=7.1 * US, bytes_per_element=2,
               memory_bandwidth=3028 * GB, attention_efficiency=0.50, host_bandwidth=HOPPER_HOST_LINK)
# DGX H200: the H100's chip and clocks (989 TFLOP/s bf16 dense) with 141 GB of HBM3e (4,800 GB/s on the data
# sheet); the same NVSwitch and NICs. Its compute terms are par4d's own measurement of one H200 (``par4d plan
# device``, torch 2.11 + CUDA 13.0, 2026-11-26; docs/planner.md, "On a GPU"): 36 bf16 GEMM shapes fitted at 0.75
# of peak and 6.2 us per GEMM (median error 6%), fused causal attention at 0.52 (cuDNN's), an element-wise sum
# at 4,349 GB/s.
H200 = Machine("h200", devices_per_node=8, peak_flops=989e12, memory_bytes=141 * GB,
               beta_intra=450 * GB, beta_inter=400 * GB, latency=NCCL_NVLINK_STEP,
               latency_inter=NCCL_NET_STEP, efficiency=0.75, kernel_latency=6.2 * US, bytes_per_element=2,
               memory_bandwidth=4349 * GB, attention_efficiency=0.52, host_bandwidth=HOPPER_HOST_LINK)
# Frontier node: 4 MI250X = 8 GCDs (191.5 TFLOP/s bf16, 64 GB and 1,638 GB/s of HBM2e each), Infinity
# Fabric between GCDs (50-200 GB/s; 100 GB/s assumed), 4 Slingshot-11 NICs = 100 GB/s per node.
# RCCL keeps NCCL's cost model; its step latencies are taken as NCCL's.
FRONTIER = Machine("frontier", devices_per_node=8, peak_flops=191.5e12, memory_bytes=64 * GB,
                   beta_intra=100 * GB, beta_inter=100 * GB, latency=NCCL_NVLINK_STEP,
                   latency_inter=NCCL_NET_STEP, efficiency=MI250X_MAMF, bytes_per_element=2,
                   memory_bandwidth=1638 * GB, attention_efficiency=0.5, host_bandwidth=FRONTIER_HOST_LINK)

BUILTIN = {m.name: m for m in (PERLMUTTER, A100_80GB, H100, H200, FRONTIER)}


def load_machine(name_or_path: str) -> Machine:
    """A built-in profile by name, or a TOML profile by path. Every error names the file and, where one is at
    fault, the key (``machine.devices_per_node``); unknown keys in ``[machine]`` are errors (a typo is never
    ignored), other tables (calibrate's ``[fit]``) are the file's own notes."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"machine {name_or_path!r}: not a built-in ({', '.join(BUILTIN)}) and no such file")
    try:
        import tomllib
    except ModuleNotFoundError as exc:  # Python 3.10
        raise ValueError("reading machine profiles needs Python >= 3.11 (tomllib)") from exc
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    table = document.get("machine")
    if not isinstance(table, dict):
        raise ValueError(f"{path}: no [machine] table")
    known = {f.name for f in fields(Machine)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown} in [machine]; valid keys are {sorted(known)}")
    missing = sorted(f.name for f in fields(Machine) if f.default is MISSING and f.name not in table)
    if missing:
        raise ValueError(f"{path}: missing keys {missing} in [machine]")
    for key, value in table.items():
        problem = _problem(key, value)
        if problem:
            raise ValueError(f"{path}: machine.{problem}")
    return Machine(**table)
