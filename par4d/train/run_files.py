"""What a run folder holds besides its checkpoints, by name, and the folder a new run gets. Free of torch: the
launcher names and checks a run before any rank exists (par4d.cli.configure) without importing the training."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from par4d.folder import Folder

METRICS, SUMMARY, PLOT = "metrics.jsonl", "summary.json", "loss.png"    # what a run writes besides checkpoints
SETTINGS = "config.toml"          # and its settings, resolved (par4d.train.settings_file)


def failure_log(out: Path, rank: int) -> Path:
    """Where a failed rank's traceback goes."""
    return Path(out) / "logs" / f"rank-{rank}.log"


def new_run_dir(grid: dict[str, int]) -> Path:
    """A new folder ``runs/<date>-<time>-<grid>`` (suffixed if it exists)."""
    shape = "-".join(f"{a}{s}" for a, s in grid.items() if s > 1) or "single"
    base = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{shape}"
    path, suffix = base, 1
    while path.exists():
        path, suffix = Path(f"{base}-{suffix}"), suffix + 1
    return path


def read_metrics(run: Folder) -> list[dict]:
    """The records of ``metrics.jsonl``; a line that is not one (a write cut short by a kill) is skipped."""
    records = []
    for line in run.read_text(METRICS).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and isinstance(record.get("loss"), float):
            records.append(record)
    return records


def restart_count() -> int:
    """How many times the elastic agent (par4d's launcher, torchrun) restarted this job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
