"""The errors GoCkpt raises: one hierarchy under :class:`CheckpointError`.

::

    RuntimeError
    └── CheckpointError                    path: the checkpoint (or directory) concerned
        ├── CheckpointCorruptError         also ValueError: a file does not decode
        ├── CheckpointTornError            the state changed while it was copied
        ├── CheckpointCancelledError       the save was cancelled before it was published
        └── CheckpointStorageError         also OSError: the filesystem / object store failed
            └── CheckpointTimeoutError     also TimeoutError: a storage deadline passed

Every class subclasses a built-in exception, so ``except RuntimeError``, ``except ValueError``
(corrupt files) and ``except OSError`` (``ENOSPC`` and friends) written against earlier versions
keep working. A :class:`CheckpointStorageError` keeps the failing call's ``errno`` and names the
file in ``filename``; the original exception is its ``__cause__``.
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type, args: tuple, state: dict, os_fields: tuple | None) -> BaseException:
    exc = cls(*args)
    exc.__dict__.update(state)
    if os_fields is not None:
        exc.errno, exc.strerror, exc.filename = os_fields
    return exc


class CheckpointError(RuntimeError):
    """Base class of every GoCkpt checkpoint error.

    Attributes:
        path: the checkpoint directory (or the directory of checkpoints) concerned, or None.
    """

    def __init__(self, *args: Any, path: str | None = None) -> None:
        super().__init__(*args)
        self.path = path

    def __reduce__(self) -> tuple:
        # Keyword-only attributes survive pickling (process pools, multiprocessing queues).
        os_fields = (
            (self.errno, self.strerror, self.filename) if isinstance(self, OSError) else None
        )
        return (_rebuild, (type(self), self.args, dict(self.__dict__), os_fields))


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint file does not decode: bad header, wrong size, checksum mismatch, a
    malformed or hostile entry (the message names the file and, where one is at fault, the key).
    """


class CheckpointTornError(CheckpointError):
    """A tensor changed while it was being copied: the snapshot would not be one step."""


class CheckpointCancelledError(CheckpointError):
    """The save was cancelled before it was published (nothing of it is left on storage)."""


class CheckpointStorageError(CheckpointError, OSError):
    """Writing, publishing or deleting a checkpoint failed in the filesystem or object store.

    The message names the checkpoint and the file; ``__cause__`` is the original error.

    Attributes:
        path: the checkpoint directory.
        filename: the file or object that failed, or None.
        errno: the original ``OSError.errno`` (e.g. ``errno.ENOSPC``), or None.
        strerror: the original error's text.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        file: str | None = None,
        errno: int | None = None,
        strerror: str | None = None,
    ) -> None:
        CheckpointError.__init__(self, message, path=path)
        self.errno = errno
        self.strerror = strerror
        self.filename = file

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointTimeoutError(CheckpointStorageError, TimeoutError):
    """A storage operation, or a wait for storage (a free host slot), passed its deadline
    (``GoCkptConfig.storage_timeout_s`` / ``slot_wait_timeout_s``)."""


__all__ = [
    "CheckpointCancelledError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointStorageError",
    "CheckpointTimeoutError",
    "CheckpointTornError",
]
