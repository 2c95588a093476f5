"""Writer claims: one process writes checkpoints (and ``latest``) in a directory at a time.

Local directories: an exclusive ``fcntl.flock`` on the checkpoint folder itself (on a lock
file ``.gockpt-writer.lock`` in it where folders cannot be flock-ed), held for the writer's
life; the kernel drops it when the process dies, in any PID namespace. Object stores: an owner object ``.gockpt-writer.json`` renewed by a daemon thread
(best effort). Staging directories carry a lock of their own (``.gockpt-lock``) so a clean-up
can tell a dead writer's staging from a live one's. See :func:`gockpt.storage.claim_directory`.

Claims are per process and reference-counted; a forked child drops its copies of the parent's
locks and claims (the parent keeps them).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from gockpt import fsutil
from gockpt._safe_read import open_regular, read_bounded
from gockpt.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger("gockpt.storage")

#: Lock file of the writing process, beside the checkpoints (local directories).
WRITER_LOCK_NAME = ".gockpt-writer.lock"
#: Owner object of the writing process, beside the checkpoints (object stores).
OWNER_OBJECT_NAME = ".gockpt-writer.json"
#: Lock file inside a staging directory, held by its writer.
STAGING_LOCK_NAME = ".gockpt-lock"
#: Default lease of an object-store writer claim, in seconds (renewed every third of it).
DEFAULT_CLAIM_LEASE_S = 30.0


@dataclass
class DirectoryClaim:
    """This process's claim to write checkpoints (and ``latest``) in one directory.

    Returned by :func:`claim_directory`; :meth:`release` it when done (also a context manager).
    Claims are per process and reference-counted: several claims of one process on one
    directory (two engines) share one lock, released with the last.

    Attributes:
        directory: the directory, as given.
        owner: what other writers see of this one: ``host``, ``pid``, ``token``,
            ``started_unix_s``.
    """

    directory: str
    owner: dict[str, Any]
    _key: str = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Give the claim back (idempotent); the lock goes with the process's last claim."""
        if self._released:
            return
        self._released = True
        _release_claim(self._key)

    def __enter__(self) -> DirectoryClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _ClaimState:
    count: int
    owner: dict[str, Any]
    lock: FileLock | None = None
    fs: AbstractFileSystem | None = None
    owner_path: str | None = None
    lease_s: float = DEFAULT_CLAIM_LEASE_S
    #: Wait for one owner-object call (:func:`gockpt.fsutil.bounded_call`); None: unbounded.
    bound_s: float | None = None
    seq: int = 0
    next_renew: float = 0.0
    released: bool = False
    io_lock: threading.Lock = field(default_factory=threading.Lock)


_CLAIMS: dict[str, _ClaimState] = {}
_CLAIMS_LOCK = threading.Lock()
_HEARTBEAT: threading.Thread | None = None
#: Set to wake the heartbeat early (a claim released: it may be the last one).
_HEARTBEAT_WAKE = threading.Event()


def claim(
    directory: str, fs: AbstractFileSystem, root: str, lease_s: float,
    timeout_s: float | None = None,
) -> DirectoryClaim:
    """Claim ``root`` of ``fs`` for this process (see :func:`gockpt.storage.claim_directory`).

    Object stores: every get, put and delete of the owner object (here, in the heartbeat and at
    release) is waited for at most ``timeout_s`` seconds; None: a third of ``lease_s`` (the
    renewal period). Past it the call is abandoned on a daemon thread
    (:func:`gockpt.fsutil.bounded_call`), so a hung store never holds the calling (training)
    thread longer. S3 is bounded by botocore instead (:func:`gockpt.fsutil.call_bound`).

    Raises:
        CheckpointError: another process holds it (names the directory and the owner).
        TimeoutError: the object store did not answer within the bound (the caller names the
            directory: :func:`gockpt.fsutil.storage_error`).
        Exception: whatever the filesystem raised (the caller names the directory).
    """
    local = isinstance(fs, LocalFileSystem)
    key = os.path.realpath(root) if local else fs.unstrip_protocol(root)
    owner = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": uuid.uuid4().hex,
        "started_unix_s": time.time(),
    }
    with _CLAIMS_LOCK:
        state = _CLAIMS.get(key)
        if state is not None:
            state.count += 1
            return DirectoryClaim(directory, dict(state.owner), key)
        if local:  # flock does not block: fine under the registry's lock
            _CLAIMS[key] = _claim_local(directory, key, owner)
            return DirectoryClaim(directory, dict(owner), key)
    # Watching another writer's owner object takes up to a lease: not under the lock.
    bound_s = fsutil.call_bound(fs, lease_s / 3 if timeout_s is None else timeout_s)
    state = _claim_remote(directory, fs, root, owner, lease_s, bound_s)
    with _CLAIMS_LOCK:
        existing = _CLAIMS.get(key)
        if existing is None:
            _CLAIMS[key] = state
    if existing is not None:  # another thread of this process claimed it meanwhile
        with existing.io_lock:
            existing.count += 1
            _put_owner(existing)
        return DirectoryClaim(directory, dict(existing.owner), key)
    _start_heartbeat()
    return DirectoryClaim(directory, dict(owner), key)


def holds_local_claim(parent: str) -> bool:
    """True if this process holds a claim on the local directory ``parent``."""
    with _CLAIMS_LOCK:
        return os.path.realpath(parent) in _CLAIMS


def _refusal(directory: str, other: dict[str, Any] | None, how: str) -> CheckpointError:
    if other:
        who = f"host {other.get('host')!r}, pid {other.get('pid')}"
        started = other.get("started_unix_s")
        if isinstance(started, (int, float)):
            who += f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
    else:
        who = "owner unknown"
    return CheckpointError(
        f"{directory}: another GoCkpt writer is saving checkpoints here ({who}; {how}). Two "
        "writers in one directory would overwrite each other's checkpoints and move 'latest' "
        "backwards: save to another directory, or stop the other writer first.",
        path=directory,
    )


def _claim_local(directory: str, key: str, owner: dict[str, Any]) -> _ClaimState:
    os.makedirs(key, exist_ok=True)
    # The folder itself is locked: nothing appears beside the checkpoints (tools and tests list
    # that folder). Where a directory cannot be flock-ed (NFS emulates flock with byte-range
    # locks, which need a file open for writing), a lock file does it; the choice depends only
    # on the filesystem, so every writer of one folder makes the same one.
    try:
        lock = FileLock.acquire_directory(key)
        how = f"it holds the flock of {key}"
        read_owner: Any = lambda: _read_owner_xattr(key)  # noqa: E731
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
        lock_path = os.path.join(key, WRITER_LOCK_NAME)
        try:
            lock = FileLock.acquire(lock_path, create=True)
        except OSError as e2:
            if e2.errno not in _NO_FLOCK:
                raise
            log.warning(
                "gockpt: %s does not support flock (%s): a second writer in this directory "
                "cannot be detected", directory, e2,
            )
            return _ClaimState(count=1, owner=owner)
        how = f"it holds {lock_path}"
        read_owner = lambda: _read_owner_file(lock_path)  # noqa: E731
    if lock is None:
        raise _refusal(directory, read_owner(), how)
    lock.write(json.dumps(owner).encode())
    return _ClaimState(count=1, owner=owner, lock=lock)


#: errno values of a filesystem (or an object) that cannot be flock-ed.
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF)
#: Extended attribute of a locked folder naming its writer (best effort: for messages only).
_OWNER_XATTR = "user.gockpt.writer"


def _read_owner_xattr(path: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(os.getxattr(path, _OWNER_XATTR, follow_symlinks=False)[:4096])
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def _read_owner_file(path: str) -> dict[str, Any] | None:
    try:
        fd = open_regular(path)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        obj = json.loads(raw)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError, CheckpointError):
        return None


def _read_owner_object(
    fs: AbstractFileSystem, path: str, bound_s: float | None
) -> dict[str, Any] | None:
    """The owner object at ``path`` (None: none; ``{}``: garbage).

    Raises:
        TimeoutError: no answer within ``bound_s``.
    """
    try:
        raw = fsutil.bounded_call(
            lambda: read_bounded(fs, path, max_bytes=4096), bound_s, f"read of {path}"
        )
        obj = json.loads(raw)
    except FileNotFoundError:
        return None
    except (ValueError, CheckpointCorruptError):
        return {}  # garbage: nobody's
    return obj if isinstance(obj, dict) else {}


def _claim_remote(
    directory: str, fs: AbstractFileSystem, root: str, owner: dict[str, Any], lease_s: float,
    bound_s: float | None,
) -> _ClaimState:
    owner_path = f"{root.rstrip('/')}/{OWNER_OBJECT_NAME}"
    other = _read_owner_object(fs, owner_path, bound_s)
    if other and other.get("token") != owner["token"]:
        # Alive means renewed: watch it for one lease (clock-free, unlike comparing stamps).
        deadline = monotonic() + lease_s * 1.1
        seen = other.get("seq")
        while monotonic() < deadline:
            time.sleep(min(lease_s / 6, max(deadline - monotonic(), 0)))
            now = _read_owner_object(fs, owner_path, bound_s)
            if not now:
                break  # released meanwhile
            if now.get("token") != other.get("token") or now.get("seq") != seen:
                raise _refusal(directory, now, f"its owner object {owner_path} is being renewed")
        else:
            log.warning(
                "gockpt: %s: taking over the claim of a writer that stopped renewing it "
                "(host %r, pid %s)", directory, other.get("host"), other.get("pid"),
            )
    state = _ClaimState(
        count=1, owner=owner, fs=fs, owner_path=owner_path, lease_s=lease_s, bound_s=bound_s,
        next_renew=monotonic() + lease_s / 3,
    )
    _put_owner(state)
    return state


def _put_owner(state: _ClaimState) -> None:
    assert state.fs is not None and state.owner_path is not None
    body = {**state.owner, "seq": state.seq, "lease_s": state.lease_s, "renewed_unix_s": time.time()}
    fs, path, data = state.fs, state.owner_path, json.dumps(body).encode()
    fsutil.bounded_call(lambda: fs.pipe_file(path, data), state.bound_s, f"put of {path}")


def _start_heartbeat() -> None:
    global _HEARTBEAT
    with _CLAIMS_LOCK:
        if _HEARTBEAT is not None:
            return
        _HEARTBEAT = threading.Thread(target=_heartbeat_loop, name="gockpt-claims", daemon=True)
        _HEARTBEAT.start()


def _heartbeat_loop() -> None:
    """(daemon thread) Renew this process's object-store owner objects every lease / 3."""
    global _HEARTBEAT
    while True:
        with _CLAIMS_LOCK:
            remote = [(k, s) for k, s in _CLAIMS.items() if s.fs is not None]
            if not remote:
                _HEARTBEAT = None
                return
        now = monotonic()
        for key, state in remote:
            if now < state.next_renew:
                continue
            state.next_renew = now + state.lease_s / 3
            try:
                with state.io_lock:
                    if state.released:
                        continue
                    current = _read_owner_object(
                        state.fs, state.owner_path, state.bound_s  # type: ignore[arg-type]
                    )
                    if current and current.get("token") != state.owner["token"]:
                        log.error(
                            "gockpt: %s: another writer took over this directory's claim "
                            "(host %r, pid %s)", key, current.get("host"), current.get("pid"),
                        )
                    state.seq += 1
                    _put_owner(state)
            except Exception as e:  # noqa: BLE001 - a missed renewal only shortens the lease
                log.warning("gockpt: %s: renewing the writer claim failed: %s", key, e)
        wake = min(s.next_renew for _, s in remote) - monotonic()
        _HEARTBEAT_WAKE.wait(min(max(wake, 0.01), 1.0))
        _HEARTBEAT_WAKE.clear()


def _stop_heartbeat_if_idle(timeout_s: float = 5.0) -> None:
    """Wake the heartbeat so it exits when no object-store claim is left, and wait for it.

    A process with no claims runs no GoCkpt thread (test harnesses check for leaked threads).
    """
    with _CLAIMS_LOCK:
        thread = _HEARTBEAT
        if thread is None or any(s.fs is not None for s in _CLAIMS.values()):
            return
    _HEARTBEAT_WAKE.set()
    if thread is not threading.current_thread():
        thread.join(timeout_s)


def _release_claim(key: str) -> None:
    with _CLAIMS_LOCK:
        state = _CLAIMS.get(key)
        if state is None:
            return
        state.count -= 1
        if state.count > 0:
            return
        del _CLAIMS[key]
    if state.lock is not None:
        state.lock.release(unlink=True)
        return
    if state.fs is None or state.owner_path is None:
        return
    with state.io_lock:
        state.released = True
        try:
            fs, path = state.fs, state.owner_path
            current = _read_owner_object(fs, path, state.bound_s)
            if current is not None and current.get("token") == state.owner["token"]:
                fsutil.bounded_call(lambda: fs.rm_file(path), state.bound_s, f"delete of {path}")
        except Exception as e:  # noqa: BLE001 - the lease expires on its own
            log.warning("gockpt: %s: removing the writer claim failed: %s", key, e)
    _stop_heartbeat_if_idle()


def _try_flock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without blocking; False (``fd`` closed) if held.

    Raises:
        OSError: locking failed otherwise (``fd`` closed).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except BaseException:
        os.close(fd)
        raise
    return True


class FileLock:
    """An exclusive ``flock`` on a lock file, verified to still be the file at its path.

    Deleting a lock file while it is locked is safe with the check: a process that locked the
    old inode finds the path gone or naming another inode, and tries again.
    """

    _held: set[FileLock] = set()

    def __init__(self, path: str, fd: int, *, directory: bool = False) -> None:
        self.path = path
        self.fd = fd
        self.directory = directory

    @classmethod
    def acquire_directory(cls, path: str) -> FileLock | None:
        """``flock`` the directory ``path`` itself, without blocking.

        Returns:
            The lock, or None if another open file holds it.

        Raises:
            OSError: opening or locking failed (``EBADF`` / ``ENOLCK`` where directories
                cannot be flock-ed).
        """
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not _try_flock(fd):
            return None
        lock = cls(path, fd, directory=True)
        cls._held.add(lock)
        return lock

    @classmethod
    def acquire(cls, path: str, *, create: bool) -> FileLock | None:
        """Lock ``path`` without blocking.

        Returns:
            The lock, or None if another open file holds it (or, with ``create=False``, the
            file is gone or was replaced).

        Raises:
            OSError: opening or locking failed (``ENOLCK`` where flock is unsupported).
        """
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        for _ in range(100):
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:
                if create:
                    raise
                return None
            if not _try_flock(fd):
                return None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                lock = cls(path, fd)
                cls._held.add(lock)
                return lock
            os.close(fd)
            if not create:
                return None
        raise OSError(errno.EAGAIN, "lock file keeps being replaced", path)

    def write(self, data: bytes) -> None:
        """Record ``data`` (the owner, for other writers' messages) with the lock."""
        if self.directory:
            try:
                os.setxattr(self.fd, _OWNER_XATTR, data)
            except OSError:
                pass  # no user xattrs here: a refusal will say "owner unknown"
            return
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self, *, unlink: bool) -> None:
        if self.fd < 0:
            return
        try:
            if self.directory:
                try:
                    os.removexattr(self.fd, _OWNER_XATTR)
                except OSError:
                    pass
            elif unlink:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        finally:
            os.close(self.fd)
            self.fd = -1
            self._held.discard(self)

    @classmethod
    def _forget_after_fork(cls) -> None:
        # A forked child (a DataLoader worker) shares the parent's open file descriptions:
        # closing its copies keeps a lock from outliving the parent in the child.
        for lock in list(cls._held):
            try:
                os.close(lock.fd)
            except OSError:
                pass
            lock.fd = -1
        cls._held.clear()


def _after_fork_in_child() -> None:
    # Only the forking thread survives: a lock another thread held stays held forever.
    global _HEARTBEAT, _CLAIMS_LOCK
    FileLock._forget_after_fork()
    _CLAIMS.clear()
    _CLAIMS_LOCK = threading.Lock()
    _HEARTBEAT = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def lock_staging(staging: str) -> FileLock:
    """Create and hold the writer lock of a new local staging directory.

    Raises:
        OSError: the lock file cannot be created.
    """
    lock = FileLock.acquire(os.path.join(staging, STAGING_LOCK_NAME), create=True)
    if lock is None:  # a brand-new directory: nobody else can hold it
        raise OSError(errno.EAGAIN, "staging lock is held by another process", staging)
    return lock
