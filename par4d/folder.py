"""A folder par4d reads and writes only inside: run folders, their checkpoints, export folders.

Run folders get shared, copied from clusters and downloaded, so their contents are not
trusted. Every file read or written through :class:`Folder` is a regular file inside it,
reached through real folders: a symbolic link anywhere below the root (a planted
``summary.json -> ~/.bashrc``) is refused, never followed, and so is a name with a
separator, ``..`` or an absolute path (a checkpoint index naming ``../../etc/passwd``).
The root itself is the user's choice and may be a link.

How: every path is opened one component at a time relative to its parent's descriptor
with ``O_NOFOLLOW`` (``openat``), files with ``O_NONBLOCK`` too (a planted FIFO must not
hang a read) and then checked to be regular with ``fstat``. Writes go to a temporary
created with ``O_CREAT | O_EXCL`` (which refuses an existing name, a link included) and
are renamed over the final name: a rename replaces a link, never writes through it.
Libraries that want a path (``safetensors``) get ``/proc/self/fd/N`` of a descriptor opened
so, which names that very file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
JSON_LIMIT = 1 << 30       # bytes: the largest JSON file read (an index of 1,000 ranks x 1,000 tensors is ~100 MB)
PROC_FD = Path("/proc/self/fd")
ABSURD_BYTES = 1 << 50     # a size read from a file, beyond any machine's memory (1 PiB): refused whatever the machine


def is_count(value: object, low: int = 0) -> bool:
    """Whether ``value`` (read from JSON) is an integer >= ``low``, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def path_kind(path: Path) -> str:
    """What ``path`` is, for a message refusing it: ``is a file``, ``is a FIFO (named pipe)``, ``does not
    exist (a.txt is a file, not a folder)``..., so that ``f"{path} {path_kind(path)}"`` reads as a sentence."""
    try:
        mode = os.stat(path).st_mode
    except NotADirectoryError:
        above = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), None)
        return "does not exist" + (f" ({above} is a file, not a folder)" if above is not None else "")
    except OSError as error:
        return "does not exist" if isinstance(error, FileNotFoundError) else f"cannot be read ({error.strerror})"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return "is " + next((name for test, name in kinds if test(mode)), "neither a file nor a folder")


class FolderError(ValueError):
    """A path inside a folder that is not a plain name, crosses a link (``link``), or is not a regular file."""

    def __init__(self, message: str, link: bool = False):
        super().__init__(message)
        self.link = link


def fd_sha256(fd: int) -> str:
    """The SHA-256 of the file open as ``fd``, read from its start (its offset is left alone)."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def fd_path(fd: int, fallback: Path) -> str:
    """A path naming the very file open as ``fd``, for a library that opens files by name: its
    ``/proc/self/fd`` entry (``fallback``, the name it was opened by, where there is no /proc)."""
    return str(PROC_FD / str(fd)) if PROC_FD.is_dir() else str(fallback)


def check_name(name: object, what: str) -> str:
    """``name`` if it is one plain file name (no separator, not ``.`` or ``..``, no NUL), else raise."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or len(name) > 255):
        raise FolderError(f"{what}: {name!r} is not a plain file name (no folders, '..' or absolute paths: "
                          f"par4d reads only files inside the folder)")
    return name


class Folder:
    """The folder ``root``; every method takes the path below it as names, ``("checkpoints", "latest")``."""

    def __init__(self, root: str | Path, prefix: tuple[str, ...] = ()):
        self.root, self.prefix = Path(root), tuple(prefix)

    def sub(self, *parts: str) -> Folder:
        """The folder ``parts`` below this one, reached as this one's files are (never through a link)."""
        return Folder(self.root, self.prefix + parts)

    @property
    def name(self) -> str:
        return self.prefix[-1] if self.prefix else self.root.name

    def path(self, *parts: str) -> Path:
        """Where ``parts`` is, for messages (opening goes through :meth:`open_fd`)."""
        return self.root.joinpath(*self.prefix, *parts)

    def __repr__(self) -> str:
        return f"Folder({str(self.path())!r})"

    # -- opening, one component at a time ------------------------------------------------

    def _below(self, parts: tuple[str, ...]) -> tuple[str, ...]:
        for part in parts:
            check_name(part, f"a path in {self.path()}")
        return self.prefix + parts

    def _open_dir(self, below: tuple[str, ...], create: bool = False) -> int:
        """A descriptor of the real folder ``below`` the root (the root itself when empty)."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                raise
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(below):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except OSError as error:
                    raise self._refused(below[:i + 1], error) from None
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def _parent(self, parts: tuple[str, ...], create: bool = False) -> Iterator[int]:
        """A descriptor of the real folder holding ``parts[-1]``; ``create``: make missing folders."""
        below = self._below(parts)
        fd = self._open_dir(below[:-1], create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _refused(self, below: tuple[str, ...], error: OSError) -> OSError:
        """A link or a non-folder where a real folder or file was expected: a FolderError naming it."""
        where = self.root.joinpath(*below)
        if error.errno in (errno.ELOOP, errno.EMLINK) or where.is_symlink():
            return FolderError(f"{where} is a symbolic link; par4d reads and writes only regular files inside "
                               f"{self.root}, never through a link (remove it)", link=True)
        if error.errno == errno.ENOTDIR:
            return FolderError(f"{where} is not a folder")
        error.filename = str(where)
        return error

    def open_fd(self, *parts: str) -> int:
        """A read-only descriptor of the regular file ``parts`` (the caller closes it)."""
        return self._open_file(parts, os.O_RDONLY)

    @contextlib.contextmanager
    def open(self, *parts: str) -> Iterator[BinaryIO]:
        with os.fdopen(self.open_fd(*parts), "rb") as f:
            yield f

    @contextlib.contextmanager
    def library_path(self, *parts: str) -> Iterator[str]:
        """A path to the regular file ``parts`` for a library that opens files by name: the
        descriptor's ``/proc/self/fd`` entry (that very file, whatever the name points to later)."""
        fd = self.open_fd(*parts)
        try:
            yield fd_path(fd, self.path(*parts))
        finally:
            os.close(fd)

    # -- reading -------------------------------------------------------------------------

    def exists(self, *parts: str) -> bool:
        """Whether ``parts`` exists (a link counts: it is there, and refused when used)."""
        try:
            with self._parent(parts) as parent:
                os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def kind(self, *parts: str) -> str | None:
        """``file``, ``folder``, ``link`` or ``other`` for what ``parts`` is (the folder itself when none);
        None if nothing is there. A link on the way to it is ``link``."""
        if not parts:
            try:
                os.close(self._open_dir(self.prefix))
                return "folder"
            except (FileNotFoundError, NotADirectoryError):
                return None
            except FolderError as error:
                return "link" if error.link else "other"
        try:
            with self._parent(parts) as parent:
                mode = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        except FolderError as error:
            return "link" if error.link else "other"
        return ("file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode)
                else "link" if stat.S_ISLNK(mode) else "other")

    def names(self, *parts: str) -> list[str]:
        """The entries of the real folder ``parts`` (of the root when none); [] if it is missing."""
        try:
            fd = self._open_dir(self._below(parts))
        except FileNotFoundError:
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def size(self, *parts: str) -> int:
        fd = self.open_fd(*parts)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_bytes(self, *parts: str, limit: int | None = None) -> bytes:
        with self.open(*parts) as f:
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > limit:
                raise FolderError(f"{self.path(*parts)} has {size:,} bytes, more than the {limit:,} par4d reads "
                                  f"from such a file")
            return f.read()

    def read_text(self, *parts: str, limit: int | None = None) -> str:
        data = self.read_bytes(*parts, limit=limit)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise FolderError(f"{self.path(*parts)} is not UTF-8 text ({error})") from None

    def read_json(self, *parts: str, limit: int = JSON_LIMIT) -> object:
        """The JSON value of ``parts``; any damage (not JSON, nested too deep) is a FolderError naming it."""
        text = self.read_text(*parts, limit=limit)
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as error:
            raise FolderError(f"{self.path(*parts)} is not readable JSON "
                              f"({'nested too deep' if isinstance(error, RecursionError) else error})") from None

    def sha256(self, *parts: str) -> str:
        fd = self.open_fd(*parts)
        try:
            return fd_sha256(fd)
        finally:
            os.close(fd)

    # -- writing -------------------------------------------------------------------------

    def mkdir(self, *parts: str, exist_ok: bool = True) -> None:
        """Make the real folder ``parts`` (and those above it); a link or file there is refused."""
        with self._parent(parts, create=True) as parent:
            try:
                os.mkdir(parts[-1], dir_fd=parent)
            except FileExistsError:
                if not exist_ok:
                    raise
                try:
                    os.close(os.open(parts[-1], _DIR, dir_fd=parent))
                except OSError as error:
                    raise self._refused(self.prefix + parts, error) from None

    def write_with(self, *parts: str, write: Callable[[BinaryIO], None], sync: bool = True) -> None:
        """Write ``parts`` whole or not at all: ``write(f)`` fills a temporary created beside it
        (``O_EXCL``: never an existing file or link), which is then renamed over ``parts``."""
        def fill(parent: int, temporary: str) -> None:
            with os.fdopen(os.open(temporary, _CREATE, 0o644, dir_fd=parent), "wb") as f:
                write(f)

        self._replace(parts, fill, sync)

    def write_file(self, *parts: str, write: Callable[[str], None]) -> None:
        """Write ``parts`` whole or not at all with a library that writes a file by name
        (``safetensors.save_file``): ``write(path)`` writes the temporary beside it, named through its
        folder's ``/proc/self/fd`` entry so that no link on the way is followed."""
        def fill(parent: int, temporary: str) -> None:
            where = PROC_FD / str(parent) if PROC_FD.is_dir() else self.path(*parts[:-1])
            write(str(where / temporary))

        self._replace(parts, fill, sync=True)

    def _replace(self, parts: tuple[str, ...], fill: Callable[[int, str], None], sync: bool) -> None:
        """``fill(folder descriptor, name)`` writes a temporary beside ``parts`` (one left by an interrupted
        write, or planted, is removed first, never written through); it must be a regular file, flushed to
        disk (``sync``), and is renamed over ``parts``: a rename replaces a link there, never follows it."""
        temporary = f".{parts[-1]}.tmp"
        with self._parent(parts, create=True) as parent:
            with contextlib.suppress(FileNotFoundError):
                self._remove_entry(parent, temporary)
            try:
                fill(parent, temporary)
                fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=parent)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise FolderError(f"{self.path(*parts)}: what was written is not a regular file")
                    if sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temporary, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException as error:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=parent)
                if isinstance(error, OSError) and error.filename is None:   # a full disk, a quota: name the file
                    raise OSError(error.errno, error.strerror or str(error), str(self.path(*parts))) from None
                raise
            if sync:
                os.fsync(parent)

    def write_bytes(self, *parts: str, data: bytes, sync: bool = True) -> None:
        self.write_with(*parts, write=lambda f: f.write(data), sync=sync)

    def write_text(self, *parts: str, text: str, sync: bool = True) -> None:
        self.write_bytes(*parts, data=text.encode("utf-8"), sync=sync)

    def _open_file(self, parts: tuple[str, ...], flags: int) -> int:
        """A descriptor of the regular file ``parts``, opened with ``flags`` (created if they say so)."""
        with self._parent(parts, create=bool(flags & os.O_CREAT)) as parent:
            try:
                fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644,
                             dir_fd=parent)
            except OSError as error:
                raise self._refused(self.prefix + parts, error) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FolderError(f"{self.path(*parts)} is not a regular file")
        os.set_blocking(fd, True)
        return fd

    def append(self, *parts: str):
        """The regular file ``parts`` opened for appending text (created if missing; never a link)."""
        return os.fdopen(self._open_file(parts, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")

    def open_rw(self, *parts: str) -> int:
        """A read-write descriptor of the regular file ``parts`` (created if missing; never a link)."""
        return self._open_file(parts, os.O_RDWR | os.O_CREAT)

    def rename(self, parts: tuple[str, ...], new_name: str) -> None:
        """Rename ``parts`` (whatever it is: a link is renamed, not followed) to ``new_name`` beside it."""
        check_name(new_name, f"a path in {self.path()}")
        with self._parent(parts) as parent:
            os.rename(parts[-1], new_name, src_dir_fd=parent, dst_dir_fd=parent)

    def remove_file(self, *parts: str) -> None:
        """Delete the file ``parts`` (a link is removed, not followed); a folder there is refused."""
        with self._parent(parts) as parent:
            if stat.S_ISDIR(os.stat(parts[-1], dir_fd=parent, follow_symlinks=False).st_mode):
                raise IsADirectoryError(errno.EISDIR, "a folder, not a file", str(self.path(*parts)))
            os.unlink(parts[-1], dir_fd=parent)

    def remove_tree(self, *parts: str) -> None:
        """Delete the real folder ``parts`` and everything in it; links in it are removed, not followed."""
        with self._parent(parts) as parent:
            try:
                fd = os.open(parts[-1], _DIR, dir_fd=parent)
            except OSError as error:
                raise self._refused(self.prefix + parts, error) from None
            try:
                for name in os.listdir(fd):
                    self._remove_entry(fd, name)
            finally:
                os.close(fd)
            os.rmdir(parts[-1], dir_fd=parent)

    def _remove_entry(self, parent: int, name: str) -> None:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        if not stat.S_ISDIR(mode):
            os.unlink(name, dir_fd=parent)
            return
        fd = os.open(name, _DIR, dir_fd=parent)
        try:
            for child in os.listdir(fd):
                self._remove_entry(fd, child)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent)
