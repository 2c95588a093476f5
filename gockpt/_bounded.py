"""Bounded calls into a filesystem that may hang (an object store, a remote filesystem).

The lowest layer of GoCkpt's storage code: :mod:`gockpt.fsutil` (which re-exports these
names) and :mod:`gockpt._safe_read` build on it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

__all__ = ["DEFAULT_STORAGE_TIMEOUT_S", "bounded_call", "bounded_fs", "call_bound", "is_local"]

#: Default bound on one object-store operation, in seconds (``GoCkptConfig.storage_timeout_s``).
DEFAULT_STORAGE_TIMEOUT_S = 60.0


def is_local(fs: AbstractFileSystem) -> bool:
    """True if ``fs`` is the local filesystem (rename, fsync and flock are available)."""
    return isinstance(fs, LocalFileSystem)


_T = TypeVar("_T")


def call_bound(fs: AbstractFileSystem, timeout_s: float | None) -> float | None:
    """How long to wait for one call into ``fs`` (a :func:`bounded_call` bound), or None.

    None for the local filesystem (its calls run on the caller's thread, as they always did),
    for S3 (botocore bounds every request, see :func:`url_to_fs`, and a request abandoned
    mid-flight would outlive the multipart-upload abort that its own timeout leads to) and when
    ``timeout_s`` is None; ``timeout_s`` for every other filesystem (memory, gcsfs, adlfs,
    custom ones), which may block forever on a hung connection.
    """
    if timeout_s is None or is_local(fs):
        return None
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"s3", "s3a"} & set(protocols):
        return None
    return float(timeout_s)


def bounded_call(fn: Callable[[], _T], timeout_s: float | None, what: str, *,
                 serial: bool = False) -> _T:
    """``fn()``, waiting at most ``timeout_s`` seconds for it.

    The call runs on a daemon worker thread (:class:`_CallPool`); the caller waits on its
    future, which releases the GIL. Past ``timeout_s`` the call is abandoned where it is: it
    keeps its daemon thread until it returns, if ever (Python cannot interrupt a thread), its
    result or error is dropped, and it does not keep the process from exiting. ``None`` calls
    ``fn`` on this thread, unbounded.

    Args:
        fn: the storage call.
        timeout_s: the bound in seconds, or None.
        what: the call, for the message (e.g. ``"write of /bucket/ckpt/shard-0.safetensors"``).
        serial: run on the one thread that runs every serial call in the order submitted, and
            let a call past its bound run later rather than never: a later call is never
            overtaken by an earlier, abandoned one (writes of the ``latest`` pointer: an older
            write landing late would move it back).

    Returns:
        What ``fn`` returned.

    Raises:
        TimeoutError: no answer within ``timeout_s`` (callers name the checkpoint and file with
            :func:`gockpt.fsutil.storage_error`, which makes it a
            :class:`~gockpt.errors.CheckpointTimeoutError`).
        RuntimeError: no worker thread could start (a thread limit; at interpreter shutdown,
            Python 3.12 refuses new threads): the call is not made.
        BaseException: whatever ``fn`` raised, unchanged.
    """
    if timeout_s is None:
        return fn()
    future = (_SERIAL if serial else _CALLS).submit(fn)
    try:
        return future.result(timeout=max(timeout_s, 0.0))
    except concurrent.futures.TimeoutError:
        if future.done():  # the call itself raised a TimeoutError (a socket's, fsspec's)
            raise
        if not serial:  # not started yet: never started; running: abandoned where it is
            future.cancel()
        raise TimeoutError(
            f"no answer from the storage within {timeout_s:g} s (storage_timeout_s) to the "
            f"{what}; the call was abandoned"
        ) from None
    finally:
        del future  # an error's traceback must not keep an abandoned call's result alive


def _run(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)


class _CallPool:
    """A daemon thread per :func:`bounded_call` call, ending with it.

    Daemon threads (not :class:`concurrent.futures.ThreadPoolExecutor`, whose workers the
    interpreter joins at exit): a call that never returns must not hang the process's exit.
    None is kept idle: a process (or a test) that stopped saving runs no thread of GoCkpt's.
    """

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """The future of ``fn()``, run on a thread of its own.

        Raises:
            RuntimeError: no thread could start; nothing runs.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=_run, args=(future, fn), name="gockpt-storage-call",
                         daemon=True).start()
        return future


class _SerialCalls:
    """Serial :func:`bounded_call` calls, run one after another in the order submitted, on one
    daemon thread that ends once none is left."""

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._running = False

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """The future of ``fn()``, run after every call submitted before it.

        Raises:
            RuntimeError: the thread could not start; nothing was queued.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._queue.append((future, fn))
            if not self._running:
                try:
                    threading.Thread(target=self._work, name="gockpt-storage-serial",
                                     daemon=True).start()
                except BaseException:
                    self._queue.pop()
                    raise
                self._running = True
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                future, fn = self._queue.popleft()
            _run(future, fn)
            del future, fn  # hold no buffer while waiting for the lock


_CALLS = _CallPool()
_SERIAL = _SerialCalls()


def _calls_after_fork_in_child() -> None:
    # The serial runner did not survive the fork; its queue and flag did.
    global _SERIAL
    _SERIAL = _SerialCalls()


os.register_at_fork(after_in_child=_calls_after_fork_in_child)


class _BoundedFS:
    """A filesystem whose every method call is a :func:`bounded_call` (attributes pass through)."""

    def __init__(self, fs: AbstractFileSystem, bound_s: float) -> None:
        self._fs, self._bound_s = fs, bound_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            what = f"{name} of {args[0]}" if args else name
            return bounded_call(lambda: attr(*args, **kwargs), self._bound_s, what)

        return call


def bounded_fs(fs: AbstractFileSystem, timeout_s: float | None) -> AbstractFileSystem:
    """``fs``, or where its calls may hang (:func:`call_bound`) a proxy whose every method call
    is waited for at most ``timeout_s`` seconds: a walk of many calls (a scan of a folder's
    manifests) takes as long as it needs while each call answers in time.

    Raises (from the proxy's calls):
        TimeoutError: a call not answered within ``timeout_s`` (abandoned on its thread).
    """
    bound = call_bound(fs, timeout_s)
    return fs if bound is None else _BoundedFS(fs, bound)  # type: ignore[return-value]
