"""What ``par4d bench checkpoint`` measures around a save or a load besides its time: the resident and
file memory sampled while it runs, the bytes read and written, and every slice par4d's loader reads."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from pathlib import Path

import torch.distributed as dist

from par4d.checkpoint import loader

SAMPLE_S = 0.01          # RssAnon/RssFile sampling interval during a timed call


def status_kb(*fields: str) -> list[int]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        values[key] = value
    return [int(values[f].split()[0]) for f in fields]


def io_counts() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value)
    return out


def trim() -> None:
    """Hand the memory freed so far back to the system, so the next phase's peak is its own."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Sampler(threading.Thread):
    """The largest RssAnon and RssFile seen every ``SAMPLE_S`` while the block runs: VmHWM has one
    peak for both, and a load through mmap (par4d's safetensors slices) maps page-cache pages,
    which count in RSS without being memory of its own. Sampled, so a shorter spike can be missed."""

    def __init__(self):
        super().__init__(daemon=True)
        self.anon, self.file = status_kb("RssAnon", "RssFile")
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(SAMPLE_S):
            anon, file = status_kb("RssAnon", "RssFile")
            self.anon, self.file = max(self.anon, anon), max(self.file, file)


@contextlib.contextmanager
def measured(record: dict):
    """Time the block from a barrier to this rank's return; its added peak and resident
    memory and its /proc/self/io deltas go into ``record``."""
    trim()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")      # VmHWM := VmRSS
    (rss, anon, file), io = status_kb("VmRSS", "RssAnon", "RssFile"), io_counts()
    sampler = Sampler()
    sampler.start()
    began = time.perf_counter()
    yield
    record["seconds"] = time.perf_counter() - began
    sampler.done.set()
    sampler.join()
    after, (hwm, rss_after) = io_counts(), status_kb("VmHWM", "VmRSS")
    record.update(peak_added_bytes=(hwm - rss) * 1024, resident_added_bytes=(rss_after - rss) * 1024,
                  rss_before_bytes=rss * 1024, anon_peak_added_bytes=(sampler.anon - anon) * 1024,
                  file_peak_added_bytes=(sampler.file - file) * 1024,
                  rchar_bytes=after["rchar"] - io["rchar"], disk_read_bytes=after["read_bytes"] - io["read_bytes"],
                  wchar_bytes=after["wchar"] - io["wchar"], disk_write_bytes=after["write_bytes"] - io["write_bytes"])


class Reads:
    """What a par4d load read: tensor bytes returned by safetensors' slices, and the files it opened."""

    def __init__(self):
        self.bytes = 0
        self.files: list[str] = []


class CountedSlice:
    def __init__(self, part, reads: Reads):
        self._part, self._reads = part, reads

    def __getitem__(self, index):
        tensor = self._part[index]
        self._reads.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def __getattr__(self, name):
        return getattr(self._part, name)


class CountedHandle:
    def __init__(self, handle, reads: Reads):
        self._handle, self._reads = handle, reads

    def get_slice(self, key):
        return CountedSlice(self._handle.get_slice(key), self._reads)

    def get_tensor(self, key):
        tensor = self._handle.get_tensor(key)
        self._reads.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def __getattr__(self, name):
        return getattr(self._handle, name)


class CountedOpen:
    """``safe_open(...)`` as :func:`par4d.checkpoint.load` uses it (a context manager), counting."""

    def __init__(self, opened, reads: Reads):
        self._opened, self._reads = opened, reads

    def __enter__(self):
        return CountedHandle(self._opened.__enter__(), self._reads)

    def __exit__(self, *exc):
        return self._opened.__exit__(*exc)


@contextlib.contextmanager
def counting_reads(reads: Reads):
    """par4d's loader, its safetensors handles counting the bytes of every slice it reads."""
    original = loader.safe_open

    def counted(path, *args, **kwargs):
        reads.files.append(str(path))
        return CountedOpen(original(path, *args, **kwargs), reads)

    loader.safe_open = counted
    try:
        yield
    finally:
        loader.safe_open = original
