"""Bounded reads of files in an untrusted checkpoint directory.

Locally only a regular file is opened, never through a symlink (in or out of the directory),
never a device, FIFO, socket or directory, and its size is checked before it is read; remotely
at most the allowed number of bytes is requested. Used for ``manifest.json``, ``latest``, owner
files and every file a manifest names.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from functools import partial

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from gockpt._bounded import DEFAULT_STORAGE_TIMEOUT_S, bounded_call, call_bound
from gockpt.errors import CheckpointCorruptError

#: Bytes per call of a read from a store whose calls are bounded one by one (a large file
#: takes as long as it needs while each piece answers in time, as writes do).
READ_PIECE_BYTES = 64 << 20


class ReplacedWhileOpenedError(CheckpointCorruptError):
    """The path named another file after the open than before it: replaced meanwhile (by a
    publish of a save of the same path, or by someone else)."""


def open_regular(path: str) -> int:
    """Open a local file for reading only if it is a regular file and not a symlink.

    ``O_NOFOLLOW`` refuses a symlink (inside or out of the directory), ``O_NONBLOCK`` keeps a
    FIFO from blocking the open, and ``lstat`` before / ``fstat`` after refuse devices, FIFOs
    and directories and anything swapped in between.

    Raises:
        FileNotFoundError: no such file.
        CheckpointCorruptError: a symlink, FIFO, device, socket or directory; a symlink loop
            on its path.
    """
    try:
        before = os.stat(path, follow_symlinks=False)
    except NotADirectoryError:
        raise FileNotFoundError(errno.ENOENT, "not found", path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a directory on the way is a symbolic link loop
            raise CheckpointCorruptError(f"{path}: a symbolic link loop on its path", path=path) from None
        raise
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointCorruptError(f"{path}: {_kind(before.st_mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointCorruptError(f"{path}: a symbolic link, not a regular file") from None
        raise
    after = os.fstat(fd)
    if not (stat.S_ISREG(after.st_mode) and os.path.samestat(before, after)):
        os.close(fd)
        raise ReplacedWhileOpenedError(f"{path}: replaced while being opened")
    return fd


def require_directory(path: str) -> None:
    """Check that a local directory of a checkpoint (a sharded checkpoint's ``rank-<r>/`` part)
    is a directory there, not a symlink to one elsewhere.

    Raises:
        CheckpointCorruptError: missing (the checkpoint names it), a symlink, or anything but a
            directory.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointCorruptError(f"{path}: missing (the checkpoint lists it)", path=path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointCorruptError(f"{path}: {_kind(st.st_mode)}, not a directory of the checkpoint",
                                     path=path)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_local_regular(path: str, expected_bytes: int | None = None) -> tuple[int, int]:
    """Open a local checkpoint file safely (see :func:`read_bounded`) for memory mapping.

    Args:
        path: the file.
        expected_bytes: the size the manifest records; None: any size.

    Returns:
        (file descriptor, size in bytes); the caller closes the descriptor.

    Raises:
        FileNotFoundError: no such file.
        CheckpointCorruptError: not a regular file, or not ``expected_bytes`` long.
    """
    fd = open_regular(path)
    size = os.fstat(fd).st_size
    if expected_bytes is not None and size != expected_bytes:
        os.close(fd)
        raise CheckpointCorruptError(
            f"{path}: {size} bytes but the manifest says {expected_bytes} (truncated or "
            "overwritten)", path=path,
        )
    return fd, size


def read_bounded(
    fs: AbstractFileSystem, path: str, *, max_bytes: int, exact_bytes: int | None = None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> bytes:
    """Read a whole file of an untrusted directory with its size bounded before reading.

    Locally only a regular file that is not a symlink is opened (no device, FIFO or link out
    of the directory). Remotely at most ``max_bytes + 1`` bytes are requested; on a store
    that may hang (not local, not S3, whose requests botocore bounds:
    :func:`gockpt.fsutil.call_bound`) in pieces of :data:`READ_PIECE_BYTES`, each waited for at
    most ``timeout_s`` seconds.

    Args:
        fs: the filesystem.
        path: the file, inside ``fs``.
        max_bytes: the largest size accepted, in bytes.
        exact_bytes: the size the file must have (the manifest's record), or None.
        timeout_s: bound on one read call into a store that may hang, in seconds (None: none).

    Returns:
        The file's bytes.

    Raises:
        FileNotFoundError: no such file.
        CheckpointCorruptError: not a regular file, over ``max_bytes``, or not ``exact_bytes``.
        TimeoutError: a read call into the store did not answer within ``timeout_s``.
    """
    limit = max_bytes if exact_bytes is None else min(max_bytes, exact_bytes)
    if isinstance(fs, LocalFileSystem):
        with os.fdopen(open_regular(path), "rb") as f:
            check_read_size(path, os.fstat(f.fileno()).st_size, max_bytes, exact_bytes)
            data = f.read(limit + 1)  # bounded even if the file grows meanwhile
    else:
        bound = call_bound(fs, timeout_s)
        if bound is None:
            data = fs.cat_file(path, start=0, end=limit + 1)
        else:
            pieces = list(read_pieces(fs, path, limit + 1, bound))
            # One piece (a file under 64 MiB) as it came; more are joined (twice a file's
            # size at the join, where the one call held it once).
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    check_read_size(path, len(data), max_bytes, exact_bytes)
    return data


def read_pieces(fs: AbstractFileSystem, path: str, end: int, bound: float | None) -> Iterator[bytes]:
    """Bytes ``[0, end)`` of ``path`` in calls of :data:`READ_PIECE_BYTES`, each bounded by
    ``bound`` seconds (None: unbounded), until the end of the file (a short piece). A piece a
    store returns longer than asked for is cut to the request, not trusted.

    Raises:
        FileNotFoundError: no such file; CheckpointTimeoutError: a call outlasted ``bound``.
    """
    at = 0
    while at < end:
        start, stop = at, min(end, at + READ_PIECE_BYTES)
        call = partial(fs.cat_file, path, start=start, end=stop)
        piece = (call() if bound is None else bounded_call(call, bound, f"read of {path}"))[:stop - start]
        yield piece
        at += len(piece)
        if len(piece) < stop - start:  # the end of the file
            return


def check_read_size(path: str, size: int, max_bytes: int, exact_bytes: int | None) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``size`` (bytes read) is ``exact_bytes`` (if
    given) and at most ``max_bytes``."""
    if exact_bytes is not None and size != exact_bytes:
        raise CheckpointCorruptError(
            f"{path}: {size} bytes but the manifest says {exact_bytes} (truncated or "
            "overwritten)", path=path,
        )
    if size > max_bytes:
        raise CheckpointCorruptError(
            f"{path}: larger than {max_bytes} bytes; not a GoCkpt metadata file", path=path
        )
