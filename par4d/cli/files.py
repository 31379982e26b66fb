"""The one check every command makes before it writes a file the user named: nothing is overwritten unless
``--force`` is given. It runs before any measurement or rank starts, so a refusal costs nothing."""

from __future__ import annotations

from pathlib import Path


def check_new_file(path: str | Path, flag: str, force: bool, label: str | None = None) -> None:
    """Refuse ``path`` (given with ``flag``, e.g. ``--out``; ``label`` names it in errors, default ``flag path``) if
    it is a folder, sits under a file, or already exists and ``force`` is false. A missing parent folder is fine:
    the writer creates it."""
    path = Path(path)
    label = label or f"{flag} {path}"
    if path.is_dir():
        raise ValueError(f"{label} is a folder; give a file path (nothing is overwritten)")
    parent = next(p for p in (path.parent, *path.parent.parents) if p.exists() or p == p.parent)
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{label}: {parent} is a file, not a folder")
    if (path.exists() or path.is_symlink()) and not force:
        raise ValueError(f"{label} already exists; pass --force to overwrite it, or choose another {flag} "
                         f"(nothing is overwritten)")
