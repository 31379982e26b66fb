"""Energy: the phantom paper's model ``e = A α + B β`` and a power monitor.

α: seconds the device computes (busy), β: seconds it waits on communication
(from the ledger); A, B: the device's busy and idle power in watts. The monitor
samples real sensors where they exist and integrates power over the training
phase only (start/stop around it), as the paper does; where none exists it says so
and callers report the model's estimate, labelled as such.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    busy_watts: float     # A
    idle_watts: float     # B
    note: str = ""

    def __post_init__(self) -> None:
        if not self.busy_watts >= self.idle_watts >= 0:
            raise ValueError(f"device {self.name!r}: need busy_watts >= idle_watts >= 0 "
                             f"(got {self.busy_watts}, {self.idle_watts})")

    def energy(self, busy_seconds: float, comm_seconds: float) -> float:
        """Joules: ``A * α + B * β``."""
        return self.busy_watts * busy_seconds + self.idle_watts * comm_seconds


FRONTIER_GCD = DeviceProfile("frontier-gcd", 560.0, 90.0, "the phantom paper's Frontier MI250X GCD figures")
# An estimate, not a measurement: this machine exposes no power sensor. One of two
# cores of a server CPU: ~10 W of package power per busy core, ~3 W idle.
CPU_CORE_ESTIMATE = DeviceProfile("cpu-core-estimate", 10.0, 3.0,
                                  "estimate for one core of a server CPU; no sensor on this machine")
PROFILES = {p.name: p for p in (FRONTIER_GCD, CPU_CORE_ESTIMATE)}


def _nvidia_reader():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:   # no driver / no device
        return None
    if not handles:
        return None
    return "nvidia-ml", lambda: sum(pynvml.nvmlDeviceGetPowerUsage(h) for h in handles) / 1000.0, "power"


def _amd_reader():
    try:
        import amdsmi
    except ImportError:
        return None
    try:
        amdsmi.amdsmi_init()
        handles = amdsmi.amdsmi_get_processor_handles()
    except Exception:
        return None
    if not handles:
        return None

    def read() -> float:
        total = 0.0
        for h in handles:
            info = amdsmi.amdsmi_get_power_info(h)
            total += float(info.get("current_socket_power") or info.get("average_socket_power") or 0.0)
        return total

    return "amdsmi", read, "power"


def _rapl_reader():
    """Linux powercap package counters (cumulative µJ): returns joules so far, unwrapped.
    The monitor integrates counters by differences, not by the trapezoid rule."""
    from pathlib import Path

    try:
        zones = [z for z in Path("/sys/class/powercap").glob("intel-rapl:*")
                 if z.name.count(":") == 1 and (z / "energy_uj").is_file()]
        wrap = [int((z / "max_energy_range_uj").read_text()) if (z / "max_energy_range_uj").is_file() else 2**32
                for z in zones]
        last = [int((z / "energy_uj").read_text()) for z in zones]
    except OSError:     # no powercap, or counters readable by root only
        return None
    if not zones:
        return None
    total = [0.0]

    def read() -> float:
        now = [int((z / "energy_uj").read_text()) for z in zones]
        total[0] += sum(((e - e0) % w) / 1e6 for e, e0, w in zip(now, last, wrap))
        last[:] = now
        return total[0]

    return "rapl", read, "energy"


def find_power_source():
    """(name, read, kind) of the first sensor found, or None; ``kind`` is "power"
    (read() gives watts) or "energy" (read() gives cumulative joules)."""
    for probe in (_nvidia_reader, _amd_reader, _rapl_reader):
        found = probe()
        if found is not None:
            return found
    return None


class EnergyMonitor:
    """Samples power every ``interval`` seconds in a thread between start() and stop();
    ``joules`` is the trapezoid integral over that window. ``available`` is False (and
    ``reason`` says why) on machines without a sensor."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        found = find_power_source()
        self.source = found[0] if found else None
        self._read = found[1] if found else None
        self.kind = found[2] if found else "power"
        self.reason = None if found else "no power sensor (NVIDIA NVML, AMD SMI or Linux RAPL) on this machine"
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._read is not None

    def start(self) -> EnergyMonitor:
        if self.available:
            self.samples = [(time.monotonic(), self._read())]
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.monotonic(), self._read()))

    def stop(self) -> float | None:
        """Stop sampling; joules over the window, or None without a sensor."""
        if not self.available:
            return None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append((time.monotonic(), self._read()))
        return self.joules

    @property
    def joules(self) -> float:
        """Power samples: trapezoid integral. Energy counters: last minus first."""
        if self.kind == "energy":
            return self.samples[-1][1] - self.samples[0][1] if self.samples else 0.0
        return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(self.samples, self.samples[1:]))
