"""An emulated storage link per process, for benchmarks: a local fsspec filesystem with paced writes.

Where every writer has storage bandwidth of its own (one NIC per node to an object store, one
disk per node), a checkpoint written by N processes takes about 1/N of the time one process
takes. On a single machine the processes share one disk and a few CPUs, so that cannot be
measured directly. This filesystem emulates it: the files are written to the local disk as
usual, but each process's writes go through one :class:`Link` that passes at most
``write_bytes_per_s`` (shared by all the process's io threads, first come first served). A
write returns once the link has carried its bytes; the disk write overlaps with that time.

It is the local filesystem of fsspec (rename, fsync and flock work as on a plain path), under
its own protocol, ``throttled``, registered with fsspec when this module is imported. GoCkpt
takes it through ``storage_options``: fsspec's ``protocol`` option makes every path resolve to
it, the plain local paths GoCkpt derives for the parts of a sharded or replicated save
included::

    import throttled_fs  # registers the protocol

    config = gockpt.GoCkptConfig(storage_options=throttled_fs.storage_options(64 * 2**20))

Reads are not paced.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

__all__ = ["PROTOCOL", "Link", "ThrottledFileSystem", "get_link", "storage_options"]

PROTOCOL = "throttled"


class Link:
    """A link that carries ``bytes_per_s`` bytes per second, one transfer after another.

    Attributes:
        bytes_per_s: the link's bandwidth, bytes per second.
        bytes_sent: bytes carried so far (transfers reserved).
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = float(bytes_per_s)
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() at which the link is idle again

    def reserve(self, nbytes: int) -> float:
        """Queue a transfer of ``nbytes`` bytes; returns the ``time.monotonic()`` it ends at."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            self.bytes_sent += nbytes
            return self._free_at

    def send(self, nbytes: int) -> None:
        """Block until a transfer of ``nbytes`` bytes has crossed the link."""
        wait_until(self.reserve(nbytes))


def wait_until(deadline: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``deadline`` (seconds); at once if past."""
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


# One link per process, name and bandwidth: fsspec caches a filesystem instance per thread, and
# every io thread of a process must share the process's link.
_LINKS: dict[tuple[int, str, float], Link] = {}
_LINKS_LOCK = threading.Lock()


def get_link(name: str, bytes_per_s: float) -> Link:
    """This process's link ``name`` of ``bytes_per_s`` bytes per second (made on first use)."""
    key = (os.getpid(), name, float(bytes_per_s))
    with _LINKS_LOCK:
        if key not in _LINKS:
            _LINKS[key] = Link(bytes_per_s)
        return _LINKS[key]


class _PacedFile(LocalFileOpener):
    """A local file whose writes cross ``link`` (the disk write overlaps the link's time)."""

    def __init__(self, path: str, mode: str, *, link: Link, **kwargs: Any) -> None:
        self._link = link
        super().__init__(path, mode, **kwargs)

    def write(self, data: Any) -> int:
        end = self._link.reserve(memoryview(data).nbytes)
        n = self.f.write(data)
        wait_until(end)
        return n


class ThrottledFileSystem(LocalFileSystem):
    """fsspec's local filesystem with every file write paced by this process's :class:`Link`.

    Args:
        write_bytes_per_s: bandwidth of the emulated link, bytes per second (per process).
        link: name of the link; filesystems of one process with the same name and bandwidth
            share it.
        **kwargs: for :class:`fsspec.implementations.local.LocalFileSystem`.

    Raises:
        ValueError: ``write_bytes_per_s`` is not a positive number.
    """

    protocol = (PROTOCOL,)

    def __init__(self, write_bytes_per_s: float, link: str = "default", **kwargs: Any) -> None:
        if not float(write_bytes_per_s) > 0:
            raise ValueError(f"write_bytes_per_s must be > 0, got {write_bytes_per_s!r}")
        super().__init__(**kwargs)
        self.link = get_link(link, write_bytes_per_s)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        if not any(c in mode for c in "wax+"):
            return super()._open(path, mode, block_size, **kwargs)
        path = self._strip_protocol(path)
        if self.auto_mkdir:
            self.makedirs(self._parent(path), exist_ok=True)
        return _PacedFile(path, mode, link=self.link, fs=self, **kwargs)


def storage_options(write_bytes_per_s: float, link: str = "default") -> dict[str, Any]:
    """GoCkpt ``storage_options`` that send every path through a :class:`ThrottledFileSystem`.

    Args:
        write_bytes_per_s: bandwidth of each process's emulated link, bytes per second.
        link: the link's name (see :class:`ThrottledFileSystem`).
    """
    return {"protocol": PROTOCOL, "write_bytes_per_s": float(write_bytes_per_s), "link": link}


fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)
