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
    latency = 10e-6            # seconds per collective step (alpha); 0 = the paper's model
    efficiency = 0.5           # fraction of peak reached by the training GEMMs
    bytes_per_element = 2      # 2 for bf16/fp16 training, 4 for fp32
    all_gather_scale = 1.0     # optional: all-gather / reduce-scatter bandwidth
    reduce_scatter_scale = 1.0 #   relative to all-reduce (full model only)
"""

from __future__ import annotations

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
    efficiency: float = 0.5
    bytes_per_element: int = 2
    # Bandwidth of all-gather / reduce-scatter relative to all-reduce's (1 for ring
    # implementations that reach the model; gloo on CPU measures well below).
    all_gather_scale: float = 1.0
    reduce_scatter_scale: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"machine {self.name!r}: {f.name}={value!r} must be a number >= 0")
        if self.devices_per_node < 1 or self.peak_flops <= 0 or self.beta_intra <= 0 or self.beta_inter <= 0:
            raise ValueError(f"machine {self.name!r}: devices_per_node, peak_flops, beta_intra and beta_inter "
                             f"must be > 0")
        if self.all_gather_scale <= 0 or self.reduce_scatter_scale <= 0:
            raise ValueError(f"machine {self.name!r}: collective scales must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"machine {self.name!r}: efficiency={self.efficiency} must be in (0, 1]")

    def to_toml(self) -> str:
        lines = ["[machine]"]
        for key, value in asdict(self).items():
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value!r}")
        return "\n".join(lines) + "\n"


GB = 1e9
# Perlmutter GPU node: 4 A100-40GB (312 TFLOP/s bf16), NVLink 3 between every GPU
# pair (4 links x 25 GB/s per direction = 100 GB/s), 4 Slingshot-11 NICs of
# 200 Gb/s = 100 GB/s per node.
PERLMUTTER = Machine("perlmutter", devices_per_node=4, peak_flops=312e12, memory_bytes=40 * GB,
                     beta_intra=100 * GB, beta_inter=100 * GB, latency=0.0, efficiency=0.5, bytes_per_element=2)
# Frontier node: 4 MI250X = 8 GCDs (192 TFLOP/s bf16 and 64 GB each), Infinity Fabric
# between GCDs (50-200 GB/s; 100 GB/s assumed), 4 Slingshot-11 NICs = 100 GB/s per node.
FRONTIER = Machine("frontier", devices_per_node=8, peak_flops=192e12, memory_bytes=64 * GB,
                   beta_intra=100 * GB, beta_inter=100 * GB, latency=0.0, efficiency=0.5, bytes_per_element=2)

BUILTIN = {m.name: m for m in (PERLMUTTER, FRONTIER)}


def load_machine(name_or_path: str) -> Machine:
    """A built-in profile by name, or a TOML profile by path."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"machine {name_or_path!r}: not a built-in ({', '.join(BUILTIN)}) and no such file")
    try:
        import tomllib
    except ModuleNotFoundError as exc:  # Python 3.10
        raise ValueError("reading machine profiles needs Python >= 3.11 (tomllib)") from exc
    table = tomllib.loads(path.read_text()).get("machine")
    if not isinstance(table, dict):
        raise ValueError(f"{path}: no [machine] table")
    known = {f.name for f in fields(Machine)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; valid keys are {sorted(known)}")
    missing = sorted(f.name for f in fields(Machine) if f.default is MISSING and f.name not in table)
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    return Machine(**table)
