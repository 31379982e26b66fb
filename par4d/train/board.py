"""A run's metrics where people look: TensorBoard event files in ``RUN/tensorboard/``, written by rank 0
through ``torch.utils.tensorboard`` beside ``metrics.jsonl`` (which stays the record tests and tools read).

Per step, under one tag each: ``loss/train``, ``loss/validation`` (every ``--eval-every`` steps),
``optimizer/lr``, ``optimizer/grad_norm`` (the global norm before clipping, where clipping computes it),
``optimizer/loss_scale`` and ``optimizer/skipped_steps`` (mixed precision), ``throughput/tokens_per_s``,
``throughput/model_flops_per_s``, ``throughput/percent_of_peak``, ``communication/exposed_s`` and
``communication/in_flight_s`` (rank 0's), ``communication/bytes``, ``memory/rss_bytes`` (rank 0's resident
memory now); at the end ``memory/peak_rss_bytes/rank_R`` and ``memory/step_holds_bytes/rank_R`` (what a step held,
par4d.train.footprint) for every rank.

The folder is made as a real folder inside the run (:class:`par4d.folder.Folder`: a link planted there is
refused); the writer names its own files (time, host and process id in the name). A resumed run opens a
new event file whose ``purge_step`` is the first step it runs, so TensorBoard drops what an interrupted
attempt wrote after the checkpoint.
"""

from __future__ import annotations

import resource
from pathlib import Path

from par4d.folder import Folder

FOLDER = "tensorboard"
TAGS = {"loss": "loss/train", "val_loss": "loss/validation", "lr": "optimizer/lr", "grad_norm": "optimizer/grad_norm",
        "loss_scale": "optimizer/loss_scale", "skipped_steps": "optimizer/skipped_steps",
        "tokens_per_s": "throughput/tokens_per_s", "model_flops_per_s": "throughput/model_flops_per_s",
        "percent_of_peak": "throughput/percent_of_peak", "comm_exposed_s": "communication/exposed_s",
        "comm_issued_s": "communication/in_flight_s", "comm_bytes": "communication/bytes",
        "rss_bytes": "memory/rss_bytes", "expert_imbalance": "experts/imbalance"}
LAYER_TAGS = {"expert_tokens_max": "experts/tokens_max", "expert_tokens_mean": "experts/tokens_mean",
              "expert_aux_loss": "experts/aux_loss", "expert_z_loss": "experts/z_loss"}


def check_available() -> None:
    """Raise, before any rank starts, where TensorBoard's writer cannot be imported."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError("TensorBoard is not installed (pip install tensorboard, as requirements.txt pins it), "
                         "or give --no-tensorboard") from None


def resident() -> dict[str, int]:
    """This process's resident memory: ``peak_bytes`` (``getrusage``'s), ``now_bytes`` and ``file_bytes``
    (of it now, file pages: memory-mapped shards are counted there, and the kernel may drop them) from
    /proc (without /proc: the peak, and 0 file pages)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"peak_bytes": peak, "now_bytes": peak, "file_bytes": 0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssFile"):
                out["now_bytes" if key == "VmRSS" else "file_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class Board:
    """Rank 0's TensorBoard writer for one run (or resumed attempt)."""

    def __init__(self, run: Folder, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        run.mkdir(FOLDER)
        # The first step run is start_step + 1: what an earlier attempt wrote from there on is dropped.
        self.writer = SummaryWriter(log_dir=str(run.path(FOLDER)), purge_step=start_step + 1)

    def step(self, step: int, record: dict) -> None:
        """The scalars of ``record`` (a ``metrics.jsonl`` line) that have a tag, at ``step``; a list (a value
        per mixture-of-experts layer) as one scalar per layer."""
        for key, tag in TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, step)
        for key, tag in LAYER_TAGS.items():
            for layer, value in enumerate(record.get(key, ())):
                self.writer.add_scalar(f"{tag}/layer_{layer}", value, step)

    def final(self, step: int, rss_per_rank: list[dict], footprints: list[dict] | None = None) -> None:
        for rank, rss in enumerate(rss_per_rank):
            self.writer.add_scalar(f"memory/peak_rss_bytes/rank_{rank}", rss["peak_bytes"], step)
        for rank, held in enumerate(footprints or []):       # par4d.train.footprint's, from the first step
            self.writer.add_scalar(f"memory/step_holds_bytes/rank_{rank}", held["total"], step)

    def close(self) -> None:
        self.writer.close()
