"""Local files another process of this host may have touched: checked paths, no links followed.

kvbridge keeps a few things on local disk that decide what an engine trusts or runs: the
per-user secret (:mod:`kvbridge.trust`), the disk offload tier's chunks
(:mod:`kvbridge.offload.tiers.disk`).
Either, swapped by someone else, would make an engine authenticate strangers or serve foreign
KV. So every such path goes through here:

* :func:`check_path` walks every component of a directory path with ``lstat``: each must be
  owned by root or by this user, and a directory that others may write must carry the sticky
  bit (``/tmp``); a symbolic link is followed only if root or this user owns it (its target is
  checked the same way). The last directory, with ``private=True``, must be this user's and
  closed to group and others (mode ``& 0o077 == 0``). Anything else raises :class:`UnsafePath`
  naming the component, its owner and its mode.
* :func:`private_dir` creates a missing directory (mode 0700, parents 0700; only below a
  directory that passes :func:`check_path`), checks it, and
  returns a directory fd opened with ``O_NOFOLLOW`` whose device and inode match the checked
  path (a swap between the check and the open is refused). Callers then name files relative to
  that fd, so later renames of the path cannot redirect them.
* :func:`subdir` opens (and with ``create`` makes, mode 0700) a subdirectory *relative to* a
  directory fd with ``O_NOFOLLOW``: a link or anything but a directory of this user's, closed
  to group and others, is refused.
* :func:`open_regular` opens a file in such a directory with ``O_NOFOLLOW | O_NONBLOCK`` and
  refuses anything but a regular file of this user's (a FIFO cannot block the reader, a link to
  ``/dev/zero`` cannot exhaust memory); it returns the fd and its ``fstat``, so the caller
  checks the size *before* reading (:func:`read_exactly` then reads a known size).
  :func:`read_regular` does both and reads exactly the size ``fstat`` gave.
* :func:`write_atomic` writes a fresh temporary file (``O_EXCL | O_NOFOLLOW``, mode 0600) in the
  directory and renames it into place — or, with ``exclusive``, links it there only if the name
  is still free, so two processes that create the same file at once agree on one content.

Blocking (file I/O). Thread-safe (no shared state). Linux and other POSIX systems.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvbridge.errors import ConfigError

__all__ = [
    "UnsafePath",
    "check_path",
    "private_dir",
    "subdir",
    "open_regular",
    "read_exactly",
    "read_regular",
    "write_atomic",
    "remove",
    "listdir",
]

_MAX_LINKS = 32


class UnsafePath(ConfigError):
    """A path component is owned by another user, writable by others, or a foreign link."""


def _describe(path: str, st: os.stat_result) -> str:
    return f"{path} (owner uid {st.st_uid}, mode 0o{stat.S_IMODE(st.st_mode):o})"


def _trusted_owner(uid: int) -> bool:
    return uid in (0, os.geteuid())


def check_path(path: str | os.PathLike[str], *, private: bool = True) -> Path:
    """Check the directory ``path`` and every component above it (see the module docstring);
    return its absolute path with links resolved. Raises :class:`UnsafePath`, or
    :class:`FileNotFoundError` when a component is missing."""
    todo = list(Path(os.path.abspath(path)).parts)
    current = Path(todo.pop(0))  # "/"
    links = 0
    while True:
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):
            if not _trusted_owner(st.st_uid):
                raise UnsafePath(f"{current} is a symbolic link owned by uid {st.st_uid}: "
                                 "kvbridge does not follow links other users could change")
            links += 1
            if links > _MAX_LINKS:
                raise UnsafePath(f"too many symbolic links below {path}")
            target = Path(os.readlink(current))
            rest = list(target.parts) if target.is_absolute() else [
                *current.parent.parts, *target.parts]
            todo = rest + todo
            current = Path(todo.pop(0))
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{current} is not a directory")
        if not _trusted_owner(st.st_uid):
            raise UnsafePath(f"{_describe(str(current), st)} belongs to another user: "
                             f"kvbridge keeps nothing below it")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UnsafePath(f"{_describe(str(current), st)} may be written by other users "
                             "(and is not sticky): anyone could replace what kvbridge keeps below")
        if not todo:
            break
        part = todo.pop(0)
        current = current.parent if part == ".." else current / part
    if private:
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{_describe(str(current), st)} must belong to this user "
                             f"(uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise UnsafePath(f"{_describe(str(current), st)} must be private to its owner "
                             "(chmod 700)")
    return current


def private_dir(path: str | os.PathLike[str], *, create: bool = True) -> int:
    """An fd of the private directory ``path`` (created 0700 with its parents if missing and
    ``create``, once the nearest existing directory above passed :func:`check_path`), checked by
    :func:`check_path`. The caller closes it."""
    target = Path(os.path.abspath(path))
    if create:
        missing = []
        probe = target
        while not os.path.lexists(probe):
            missing.append(probe)
            probe = probe.parent
        if missing:  # create nothing below a directory (or through a link) others control
            check_path(probe, private=False)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
    real = check_path(target, private=True)
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st, checked = os.fstat(fd), os.lstat(real)
        if (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
            raise UnsafePath(f"{real} changed while it was being opened")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafePath(f"{_describe(str(real), st)} must be this user's and private")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a file name: {name[:80]!r}")


def subdir(dir_fd: int, name: str, *, create: bool = True) -> int:
    """An fd of the subdirectory ``name`` of ``dir_fd`` (made mode 0700 when missing and
    ``create``), opened with ``O_NOFOLLOW``. The caller closes it.

    Raises :class:`FileNotFoundError` when absent (and not ``create``), :class:`UnsafePath` for
    a link, anything but a directory, or a directory that is not this user's and private."""
    _check_name(name)
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(f"{name} is a symbolic link or not a directory; refused") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafePath(f"{_describe(name, st)} must be this user's and private; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of the regular file ``name`` in ``dir_fd``, opened read-only with
    ``O_NOFOLLOW | O_NONBLOCK`` (see the module docstring). The caller closes the fd.

    Raises :class:`FileNotFoundError` when absent and :class:`UnsafePath` for a link, a
    non-regular file or a file of another owner (nothing is read)."""
    _check_name(name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{name} is a symbolic link; refused") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{name} is not a regular file; refused")
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{name} belongs to uid {st.st_uid}, not this user; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_exactly(fd: int, size: int, offset: int = 0) -> bytes:
    """``size`` bytes of ``fd`` from ``offset`` (``pread``); :class:`ValueError` if the file
    ends before."""
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    chunks = [data]
    got = len(data)
    while got < size:
        chunk = os.pread(fd, min(size - got, 1 << 24), offset + got)
        if not chunk:
            raise ValueError(f"file ended after {got} of {size} bytes (it changed while read)")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_regular(dir_fd: int, name: str, max_bytes: int,
                 expected: int | None = None) -> bytes:
    """The bytes of the regular file ``name`` in ``dir_fd`` (see the module docstring).

    Raises :class:`FileNotFoundError` when absent, :class:`UnsafePath` for a link, a non-regular
    file or a file of another owner, and :class:`ValueError` when its size is above
    ``max_bytes`` or differs from ``expected`` (checked before anything is read)."""
    fd, st = open_regular(dir_fd, name)
    try:
        if st.st_size > max_bytes:
            raise ValueError(f"{name} is {st.st_size} bytes, above the limit of {max_bytes}")
        if expected is not None and st.st_size != expected:
            raise ValueError(f"{name} is {st.st_size} bytes, expected {expected}")
        try:
            return read_exactly(fd, st.st_size)
        except ValueError:
            raise ValueError(f"{name} shrank while it was read") from None
    finally:
        os.close(fd)


def write_atomic(dir_fd: int, name: str, data: bytes, *, fsync: bool = False,
                 exclusive: bool = False) -> bool:
    """Write ``data`` as ``name`` in ``dir_fd`` (mode 0600) atomically: readers see the old
    file or the whole new one. With ``exclusive``, only if ``name`` does not exist yet: returns
    False (and writes nothing) when it does. Raises :class:`OSError` on failure, leaving no
    temporary file behind."""
    tmp = f".tmp-{os.urandom(8).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileExistsError:
                return False
        else:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            tmp = ""
        return True
    finally:
        if tmp:
            remove(dir_fd, tmp)


def remove(dir_fd: int, name: str) -> None:
    """Unlink ``name`` in ``dir_fd`` if it exists (never follows a link: unlink removes it)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def listdir(dir_fd: int) -> list[str]:
    """The names in ``dir_fd`` (without following anything)."""
    dup = os.dup(dir_fd)
    try:
        return os.listdir(dup)
    finally:
        os.close(dup)
