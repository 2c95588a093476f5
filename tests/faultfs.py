"""Fault-injecting fsspec filesystems: the public storage seam tests use to break storage.

GoCkpt opens every checkpoint file through the fsspec filesystem of its path, so a filesystem
registered under a test protocol is enough to make writes, deletes and reads fail, block or
stall, with no patching of GoCkpt itself:

- ``gockptfaultfile:///abs/path``: the local filesystem (GoCkpt treats it as local: staging,
  rename, fsync, flock), with faults.
- ``gockptfaultmem://root``: a memory filesystem of its own (an object store: no rename), with
  faults.

Each class has a :class:`Fault` (class attribute ``fault``; swap it with ``monkeypatch.setattr``):
``hook(name, nbytes)`` runs before every write to a file whose name contains ``match``, and
``op_hook(op, path)`` before ``pipe``/``rm``/``cat``/``ls``/``info`` operations.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

LOCAL_PROTOCOL = "gockptfaultfile"
MEMORY_PROTOCOL = "gockptfaultmem"


@dataclass
class Fault:
    """What to break.

    Attributes:
        hook: None (disarmed) or ``hook(file_name, nbytes)``, run before each write to a file
            whose name contains ``match``; it may raise, block or set events.
        match: substring of file names ``hook`` applies to.
        written: bytes written so far to matching files while armed.
        op_hook: None or ``op_hook(op, path)`` with op in ``"pipe"``, ``"rm"``, ``"cat"``,
            ``"ls"``, ``"info"`` (``exists``, ``isdir``, ``size`` ...), ``"open"`` (any open for
            writing), run before the operation.
    """

    hook: Callable[[str, int], None] | None = None
    match: str = ".safetensors"
    written: int = 0
    op_hook: Callable[[str, str], None] | None = None

    def before_write(self, name: str, nbytes: int) -> None:
        if self.hook is not None and self.match in name:
            self.hook(name, nbytes)
            self.written += nbytes

    def before_op(self, op: str, path: str) -> None:
        if self.op_hook is not None:
            self.op_hook(op, path)

    def raise_after(self, exc: BaseException, after_bytes: int) -> None:
        """Arm: raise ``exc`` on the write that would pass ``after_bytes`` matching bytes."""

        def hook(name: str, nbytes: int) -> None:
            if self.written + nbytes > after_bytes:
                raise exc

        self.written = 0
        self.hook = hook

    def hang(self, ops: Collection[str], until: threading.Event) -> None:
        """Arm: the calls in ``ops`` block until ``until`` is set (a hung connection with no
        timeout of its own). ``"write"`` is a write to a file whose name contains ``match``;
        the others are ``op_hook`` operations (``"pipe"``, ``"rm"``, ``"cat"``, ``"ls"``,
        ``"info"``, ``"open"``).
        Set ``until`` when the test ends: the blocked calls then return."""
        ops = set(ops)

        def block(*_: object) -> None:
            until.wait()

        self.hook = block if "write" in ops else None
        self.op_hook = (lambda op, path: block() if op in ops else None) if ops - {"write"} else None


class _FaultyFile:
    """A file whose writes go through a :class:`Fault` first."""

    def __init__(self, f: Any, fault: Fault, name: str) -> None:
        self._f = f
        self._fault = fault
        self._name = name

    def write(self, data: Any) -> int:
        self._fault.before_write(self._name, len(data))
        return self._f.write(data)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._f, attr)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class _FaultHooks:
    """The operations both fault filesystems pass through their :class:`Fault` first."""

    fault: Fault
    protocol: str

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        if isinstance(path, str):
            path = path.removeprefix(f"{cls.protocol}://")
        return super()._strip_protocol(path)  # type: ignore[misc]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode:
            self.fault.before_op("open", path)
        f = super()._open(path, mode=mode, **kwargs)  # type: ignore[misc]
        if "w" in mode:
            return _FaultyFile(f, self.fault, str(path).rpartition("/")[2])
        return f

    def rm_file(self, path: str) -> None:
        self.fault.before_op("rm", path)
        super().rm_file(path)  # type: ignore[misc]

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        self.fault.before_op("rm", str(path))
        super().rm(path, recursive=recursive, maxdepth=maxdepth)  # type: ignore[misc]

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        self.fault.before_op("cat", path)
        return super().cat_file(path, start=start, end=end, **kwargs)  # type: ignore[misc]

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self.fault.before_op("ls", path)
        return super().ls(path, detail=detail, **kwargs)  # type: ignore[misc]

    def info(self, path: str, **kwargs: Any) -> Any:
        self.fault.before_op("info", path)
        return super().info(path, **kwargs)  # type: ignore[misc]


class FaultLocalFileSystem(_FaultHooks, LocalFileSystem):
    """The local filesystem under ``gockptfaultfile://``, with :attr:`fault`."""

    protocol = LOCAL_PROTOCOL
    fault = Fault()

    def unstrip_protocol(self, name: str) -> str:
        return f"{LOCAL_PROTOCOL}://{self._strip_protocol(name)}"


class FaultMemoryFileSystem(_FaultHooks, MemoryFileSystem):
    """A memory filesystem of its own under ``gockptfaultmem://``, with :attr:`fault`."""

    protocol = MEMORY_PROTOCOL
    store: dict = {}
    pseudo_dirs: list = [""]
    fault = Fault()

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        self.fault.before_op("pipe", path)
        super().pipe_file(path, value, *args, **kwargs)


fsspec.register_implementation(LOCAL_PROTOCOL, FaultLocalFileSystem, clobber=True)
fsspec.register_implementation(MEMORY_PROTOCOL, FaultMemoryFileSystem, clobber=True)


def local_url(path: Any) -> str:
    """``gockptfaultfile://`` URL of a local path."""
    return f"{LOCAL_PROTOCOL}://{path}"


def memory_root() -> str:
    """A fresh ``gockptfaultmem://`` root."""
    return f"{MEMORY_PROTOCOL}://gockpt-fault-{uuid.uuid4().hex}"


def clear_memory(root: str) -> None:
    fs = FaultMemoryFileSystem()
    path = FaultMemoryFileSystem._strip_protocol(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)
