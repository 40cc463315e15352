"""The one home for reading user files and writing outputs safely.

Reads: a spec (or any user input) is read with a size limit, device files and
directories are refused, and undecodable bytes name the file. Writes: every
output (CLI ``-o``, compiled modules, cache entries) goes through
``atomic_write``: a temporary file in the destination directory, fsynced, then
one ``os.replace``, so readers see the old file or the whole new one. It
replaces only regular files (never a symlink, a device node or a FIFO), creates
files with the process's umask like ``open()`` would, and creates missing parent
directories only when asked.

Only the standard library is imported here.
"""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Union

# A spec larger than this is not a spec: refuse it before reading it whole.
MAX_SPEC_BYTES = 4 * 1024 * 1024


class InputFileError(ValueError):
    """A user's input file that cannot be read as text (missing, a directory, a device, too large, binary)."""


class OutputFileError(ValueError):
    """An output destination that fp4gen refuses to write (not a regular file, no parent directory)."""


def read_text_file(path: Union[str, os.PathLike], *, limit: int = MAX_SPEC_BYTES, what: str = "spec") -> str:
    """The UTF-8 text of ``path``; ``InputFileError`` (naming the file) for anything that is not one."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputFileError(f"{p}: no such {what} file") from None
    except OSError as e:
        raise InputFileError(f"{p}: cannot read {what} file: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputFileError(f"{p}: is a directory, not a {what} file")
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"{p}: is not a regular file (device, FIFO or socket); give a {what} file")
    if st.st_size > limit:
        raise InputFileError(f"{p}: {st.st_size} bytes is larger than the {limit}-byte limit for a {what} file")
    try:
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise InputFileError(f"{p}: cannot read {what} file: {e.strerror or e}") from None
    if len(raw) > limit:  # grew between stat and read
        raise InputFileError(f"{p}: larger than the {limit}-byte limit for a {what} file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{p}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                             f"is this a binary file?") from None


def check_output_path(path: Union[str, os.PathLike], *, parents: bool = False) -> Path:
    """``path`` if ``atomic_write`` may write it, else ``OutputFileError`` saying why."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise OutputFileError(f"{p}: is a symbolic link; fp4gen replaces only regular files")
        if stat.S_ISDIR(st.st_mode):
            raise OutputFileError(f"{p}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise OutputFileError(f"{p}: is not a regular file (device, FIFO or socket); fp4gen does not write there")
        # the mode bits too: os.access grants root everything, and root's -o would replace a 0444 file
        if not os.access(p, os.W_OK) or not st.st_mode & 0o222:
            raise OutputFileError(f"{p}: is read-only; remove it or make it writable first")
    parent = p.parent
    if not parent.exists():
        if not parents:
            raise OutputFileError(f"{p}: directory '{parent}' does not exist (create it, or pass --parents)")
    elif not parent.is_dir():
        raise OutputFileError(f"{p}: '{parent}' is not a directory")
    return p


def atomic_write(path: Union[str, Path], data: Union[str, bytes], *, parents: bool = False) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    Refuses (``OutputFileError``) a destination that is a symlink, a directory, a
    device node or a FIFO, a read-only file, and a missing parent directory unless
    ``parents``. The new file's mode follows the umask (``0o666 & ~umask``), or
    keeps the mode of the regular file it replaces.
    """
    p = check_output_path(path, parents=parents)
    if parents:
        p.parent.mkdir(parents=True, exist_ok=True)
    try:
        keep_mode = stat.S_IMODE(os.stat(p).st_mode)
    except FileNotFoundError:
        keep_mode = None
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = _create_temp(p)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            if keep_mode is not None:
                os.fchmod(f.fileno(), keep_mode)
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return p


def _create_temp(p: Path) -> "tuple[int, Path]":
    """A new empty file beside ``p``, opened for writing.

    Created with mode 0o666 so that the kernel applies the umask as ``open()``
    does (``tempfile.mkstemp`` forces 0o600, and reading the umask means setting
    it, which races with other threads creating files). O_EXCL never follows a
    planted symlink.
    """
    while True:
        tmp = p.parent / f".{p.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
