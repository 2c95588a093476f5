"""Storage targets: where one save's files go and how it is published (a public seam).

:func:`gockpt.persist.persist` writes every file of a save through a :class:`StorageTarget`
and publishes through it; :func:`open_target` picks the default one for a path. A caller can
plug its own (``PersistRequest.target_factory``): another publish protocol, or faults injected
into writes and publishes in tests.

- :class:`LocalTarget`: a staging directory beside the checkpoint, renamed (or atomically
  exchanged) into place, parent fsynced (PCcheck §4.1); across devices a copy, manifest last.
- :class:`ObjectTarget`: files written in place under names unique to the save, the manifest
  put last publishes (GoCkpt §4.4.3: the metadata marks completion).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import monotonic
from typing import Any

import xxhash
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from gockpt import _direct, _trace, fsutil, storage
from gockpt.manifest import check_name

__all__ = ["FileOrigin", "LocalTarget", "ObjectTarget", "StorageTarget", "open_target"]

log = logging.getLogger("gockpt.persist")


def open_target(
    fs: AbstractFileSystem, root: str, names: list[str], timeout_s: float | None
) -> StorageTarget:
    """The default target of a checkpoint at ``root`` of ``fs``.

    Args:
        fs, root: the filesystem and the checkpoint directory's path in it.
        names: every file name the save will write (object stores refuse names the published
            checkpoint at ``root`` uses).
        timeout_s: object stores: bound in seconds on one call into the store (a piece
            write, the manifest's get or put, ...: see :class:`ObjectTarget`); None: none.

    Raises:
        ValueError: a name belongs to the published checkpoint at ``root`` (object stores).
        OSError: the staging directory or its lock cannot be created (local).
    """
    if storage.is_local(fs):
        return LocalTarget(fs, root)
    return ObjectTarget(fs, root, names, timeout_s)


@dataclass(frozen=True)
class FileOrigin:
    """A file a published checkpoint holds, as it was right after the publish: a later save
    that would write the same bytes links it instead (:meth:`StorageTarget.link`).

    Attributes:
        path: its path in the local filesystem.
        dev, ino, size, mtime_ns: its ``lstat`` then (device, inode, bytes, modification time
            in nanoseconds): a link is kept only to that very file, unmodified.
        digest: xxh3-64 hex digest of its bytes, as in that checkpoint's manifest.
    """

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    digest: str

    @classmethod
    def of(cls, path: str, digest: str) -> FileOrigin:
        """The origin of the regular file at ``path``, which holds bytes of ``digest``.

        Raises:
            OSError: it cannot be ``lstat``-ed, or it is not a regular file.
        """
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, digest)

    def same_file(self, st: os.stat_result) -> bool:
        """Whether ``st`` is this very file, unmodified since."""
        return (stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                == (self.dev, self.ino, self.size, self.mtime_ns))


class StorageTarget:
    """Where one save writes and how it is published.

    Call order: :meth:`write` for every file (from several io threads at once), then
    :meth:`prepare` and :meth:`publish` with the manifest bytes, then :meth:`cleanup`, which
    always runs last (also after an error) and never raises.

    Attributes:
        manifest_path: where the manifest is written (for error messages).
    """

    manifest_path: str

    def file_path(self, name: str) -> str:
        """The path (in the target's filesystem) file ``name`` is written to."""
        raise NotImplementedError

    def write(
        self, name: str, pieces: Iterator[memoryview | bytes], check: Callable[[], None]
    ) -> tuple[int, str]:
        """Write ``pieces`` as file ``name``; call ``check()`` before each piece (it raises
        to abort). Returns (bytes written, xxh3-64 hex digest of them)."""
        raise NotImplementedError

    def link(self, name: str, origin: FileOrigin) -> tuple[int, str] | None:
        """Make file ``name`` the file of ``origin`` without writing it (a hard link), where
        the target can and the file is still as it was published. Returns (bytes, xxh3-64 hex
        digest) as :meth:`write` does, or None: then the caller writes the file. Never raises
        for a link that cannot be made. The default links nothing."""
        return None

    def local_path(self, name: str) -> str | None:
        """Where file ``name`` of the published checkpoint lies in the local filesystem, for a
        later save's :meth:`link`; None where the target links nothing."""
        return None

    def prepare(self, manifest: bytes) -> None:
        """Make the manifest ready to publish (outside the publish lock)."""

    def publish(self, manifest: bytes) -> None:
        """Make the checkpoint complete and visible at once (under the publish lock)."""
        raise NotImplementedError

    def cleanup(self, published: bool) -> None:
        """Remove whatever of this save is not the published checkpoint; never raises."""
        raise NotImplementedError


class LocalTarget(StorageTarget):
    """A staging directory beside the checkpoint, renamed into place (PCcheck §4.1).

    The staging directory holds a lock file, ``flock``-ed until the publish, so a clean-up in
    any process (any PID namespace) sees that this writer is alive.
    """

    def __init__(self, fs: AbstractFileSystem, root: str, staging: str | None = None, *,
                 direct_io: bool = True, framework_names: re.Pattern[str] | None = None) -> None:
        """
        Args:
            fs, root: the local filesystem and the checkpoint directory.
            staging: an existing, empty directory in ``root``'s parent to write into (created
                by the caller at request time, so other processes can add their files, named
                ``.<name>.gockpt-tmp-<pid>-<hex>`` so :func:`gockpt.storage.cleanup_staging`
                knows it); None: a new one.
            direct_io: write files with ``O_DIRECT`` where the filesystem allows it
                (:mod:`gockpt._direct`); False: through the page cache.
            framework_names: entries of a checkpoint its framework wrote itself, which the
                publish replaces like a checkpoint
                (:attr:`gockpt.writer.CheckpointWriter.framework_names`).
        """
        self.fs = fs
        self.direct_io = direct_io
        self.framework_names = framework_names
        self.root = root
        self.parent, name = fsutil.split(root)
        if fsutil.SCRATCH_RE.match(os.path.basename(self.parent)) and not os.path.isdir(self.parent):
            # A part of a sharded checkpoint whose staging directory was removed: its commit
            # was abandoned (a failed run); making it again would only leave it behind.
            raise FileNotFoundError(f"{self.parent}: the staging directory of {root} is gone "
                                    "(its checkpoint was abandoned)")
        os.makedirs(self.parent, exist_ok=True)
        tag = f"{os.getpid()}-{uuid.uuid4().hex}"
        self.aside = os.path.join(self.parent, f".{name}.gockpt-old-{tag}")
        if staging is None:
            self.staging = os.path.join(self.parent, f".{name}.gockpt-tmp-{tag}")
            os.mkdir(self.staging)
        else:
            # One directory however spelled (the engine resolves the checkpoint's parent at the
            # request; a writer may name its staging folder through a symlinked parent).
            if os.path.realpath(os.path.dirname(os.path.abspath(staging))) != os.path.realpath(self.parent):
                raise ValueError(f"staging {staging} must be in {self.parent} (one rename away)")
            self.staging = staging
        try:
            self.lock = storage.lock_staging(self.staging)
        except BaseException:
            fsutil.remove_local(self.staging)
            raise
        self.manifest_path = os.path.join(self.staging, storage.MANIFEST_NAME)

    def file_path(self, name: str) -> str:
        return os.path.join(self.staging, name)

    @staticmethod
    def exchange(a: str, b: str) -> bool:
        """Atomically swap two existing paths; False where the system cannot (then the old
        checkpoint is moved aside and the new one renamed in: two renames)."""
        return _exchange(a, b)

    def write(
        self, name: str, pieces: Iterator[memoryview | bytes], check: Callable[[], None]
    ) -> tuple[int, str]:
        digest = xxhash.xxh3_64()
        if self._plain_local:  # around the page cache
            nbytes = _direct.write_file(self.file_path(name), pieces, check, digest,
                                        direct=self.direct_io)
            return nbytes, digest.hexdigest()
        nbytes = 0
        with self.fs.open(self.file_path(name), "wb") as f:
            for piece in pieces:
                check()
                n = len(piece)
                with _trace.phase("write", n):
                    f.write(piece)
                with _trace.phase("checksum", n):
                    digest.update(piece)
                nbytes += n
            with _trace.phase("fsync", nbytes):
                f.flush()
                os.fsync(f.fileno())
        return nbytes, digest.hexdigest()

    @property
    def _plain_local(self) -> bool:
        """fsspec's own local filesystem: direct writes and links. A subclass (such as a test's
        fault-injecting one) keeps its own ``open`` and links nothing."""
        return type(self.fs) is LocalFileSystem

    def link(self, name: str, origin: FileOrigin) -> tuple[int, str] | None:
        if not self._plain_local:
            return None
        dst = self.file_path(name)
        try:
            # Not following a symlink: one put in the origin's place is linked as itself and
            # then refused below, never the file it points to.
            os.link(origin.path, dst, follow_symlinks=False)
        except OSError:  # gone (rotated away), another device, links not supported: write
            return None
        try:
            if origin.same_file(os.lstat(dst)):
                return origin.size, origin.digest
            os.unlink(dst)  # another file (replaced, modified since): write ours instead
        except OSError as e:
            raise storage.storage_error(e, self.root, dst) from e
        return None

    def local_path(self, name: str) -> str | None:
        return os.path.join(self.root, name) if self._plain_local else None

    def prepare(self, manifest: bytes) -> None:
        with self.fs.open(self.manifest_path, "wb") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        storage.fsync_path(self.staging)

    def publish(self, manifest: bytes) -> None:
        # The lock file must not enter the checkpoint; the lock itself stays held (on the
        # unlinked inode) until cleanup, and a cleaner that finds no lock file in a staging
        # directory leaves it to its owner's PID (see storage.cleanup_staging).
        storage.unlock_staging(self.lock, unlink=True)
        self.lock = None
        # Checked at the request too; again here, since the folder is swapped out and deleted.
        fsutil.check_replaceable(self.root, self.framework_names)
        try:
            if not os.path.lexists(self.root):
                os.rename(self.staging, self.root)
            elif not self.exchange(self.staging, self.root):
                # No atomic exchange here: move the old checkpoint aside, then rename; a crash
                # in between leaves it at the aside name, which cleanup_staging renames back.
                os.rename(self.root, self.aside)
                try:
                    os.rename(self.staging, self.root)
                except BaseException:
                    os.rename(self.aside, self.root)
                    raise
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            self._publish_by_copy()
        storage.fsync_path(self.parent)

    def _publish_by_copy(self) -> None:
        """Publish across devices (the path is a mount point, ...): copy, manifest last.

        Not atomic, but never taken for complete early: a copy without its manifest is not a
        checkpoint (strict ``is_complete``). A previous checkpoint at the same path loses its
        manifest first, so a crash in between leaves nothing that looks complete.
        """
        log.warning(
            "gockpt: %s is on another device than its parent folder: publishing by copy "
            "(not atomic; a crash during the copy leaves no checkpoint at this path)", self.root,
        )
        if os.path.lexists(self.root):
            fsutil.remove_local_checkpoint(self.root)
        os.makedirs(self.root, exist_ok=True)
        names = sorted(n for n in os.listdir(self.staging) if n != storage.MANIFEST_NAME)
        for batch in (names, [storage.MANIFEST_NAME]):
            for name in batch:
                dst = os.path.join(self.root, name)
                shutil.copyfile(os.path.join(self.staging, name), dst)  # sendfile: GIL released
                storage.fsync_path(dst)
            storage.fsync_path(self.root)  # the shards' entries are durable before the manifest

    def cleanup(self, published: bool) -> None:
        # After an exchange the staging name holds the previous checkpoint.
        for path in (self.staging, self.aside):
            try:
                if published and os.path.isdir(path) and not os.path.islink(path):
                    try:
                        # Checked before the swap; files added since are someone's: kept.
                        fsutil.check_replaceable(path, self.framework_names)
                    except FileExistsError:
                        kept = f"{self.root}.gockpt-kept-{uuid.uuid4().hex[:8]}"
                        os.rename(path, kept)
                        log.warning("gockpt: files were added to %s while it was being "
                                    "replaced; its previous content is kept at %s",
                                    self.root, kept)
                        continue
                fsutil.remove_local(path)
            except Exception as e:  # noqa: BLE001 - never mask the save's own outcome
                log.warning("gockpt: could not remove %s (cleanup_staging will): %s", path, e)
        storage.unlock_staging(self.lock, unlink=False)
        self.lock = None


class ObjectTarget(StorageTarget):
    """Files written in place under names unique to this save; the manifest put publishes.

    A failed file is discarded (s3fs: its multipart upload aborted), then every object this
    save started is deleted in one bulk request; the original error is what the save raises.

    Bounded waits: on a store other than the local filesystem and S3 (whose requests botocore
    bounds), every call that may block (an open, each piece write and the close of a file, the
    manifest's get and put, the checks and ``makedirs`` of the constructor) runs on a daemon
    worker thread, waited for at most ``timeout_s`` (:func:`gockpt.fsutil.bounded_call`): one
    piece write is one operation, so a large file takes as long as it needs while each of its
    pieces answers in time. Past it the call is abandoned on its thread and the save fails with
    a ``TimeoutError`` (:class:`~gockpt.errors.CheckpointTimeoutError` once persist names the
    checkpoint and file). :meth:`cleanup` as a whole is bounded by ``timeout_s`` too: what it
    has not done by then goes on in the background, with a warning.
    """

    def __init__(
        self, fs: AbstractFileSystem, root: str, names: list[str], timeout_s: float | None
    ) -> None:
        self.fs = fs
        self.root = root
        self.timeout_s = timeout_s
        #: The wait for one call into ``fs`` (None: the call runs on the calling thread).
        self.bound_s = fsutil.call_bound(fs, timeout_s)
        self.manifest_path = fsutil.join(root, storage.MANIFEST_NAME)
        self.started: list[str] = []
        #: (file, path) of the files whose write failed: discarded first by :meth:`cleanup`.
        self.failed: list[tuple[Any, str]] = []
        self.replaced: set[str] = set()
        #: The manifest put failed: a try of it may still land, naming this save's files.
        self.publish_in_flight = False
        clash = sorted(set(names) & (self._manifest_files() or set()))
        if clash:
            # Overwriting a file the published manifest names would corrupt it in place.
            raise ValueError(
                f"{root}: file {clash[0]!r} belongs to the published checkpoint; "
                "shard prefixes must be unique per save"
            )
        # Object stores need no directories; filesystems without rename (sftp, ...) do.
        self.created_dir = not self._call(f"check of {root}", fs.exists, root)
        if self.created_dir:
            self._call(f"makedirs of {root}", functools.partial(fs.makedirs, exist_ok=True), root)

    def file_path(self, name: str) -> str:
        return fsutil.join(self.root, name)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, waited for at most :attr:`bound_s` (``TimeoutError`` past it)."""
        if self.bound_s is None:
            return fn(*args)
        return fsutil.bounded_call(functools.partial(fn, *args), self.bound_s, what)

    def _timed(self, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one write call; past ``timeout_s`` the file fails: no answer is waited for
        longer (:meth:`_call`), and on S3 a call that came back late fails too."""
        if self.bound_s is not None:
            return self._call(f"write of {path}", fn, *args)
        t0 = monotonic()
        out = fn(*args)
        if self.timeout_s is not None and monotonic() - t0 > self.timeout_s:
            # The caller names the checkpoint and file (storage.storage_error).
            raise TimeoutError(f"one write took over {self.timeout_s:g} s (storage_timeout_s)")
        return out

    def write(
        self, name: str, pieces: Iterator[memoryview | bytes], check: Callable[[], None]
    ) -> tuple[int, str]:
        digest = xxhash.xxh3_64()
        nbytes = 0
        path = self.file_path(name)
        self.started.append(name)
        f = self._call(f"open of {path}", self.fs.open, path, "wb")
        try:
            for piece in pieces:
                check()
                n = len(piece)
                with _trace.phase("write", n):
                    self._timed(path, f.write, piece)
                with _trace.phase("checksum", n):
                    digest.update(piece)
                nbytes += n
            self._timed(path, f.close)
        except BaseException:
            self.failed.append((f, path))  # discarded by cleanup, within its bound
            raise
        return nbytes, digest.hexdigest()

    def _manifest_files(self) -> set[str] | None:
        """The plain file names the manifest at ``root`` lists (empty: none there; None: it
        does not decode or cannot be read).

        Raises:
            TimeoutError: the store did not answer within :attr:`bound_s`.
        """
        return self._call(f"read of {self.manifest_path}", self._read_manifest_files)

    def _read_manifest_files(self) -> set[str] | None:
        try:
            raw = storage.read_bounded(
                self.fs, self.manifest_path, max_bytes=storage.MAX_METADATA_BYTES
            )
            files = json.loads(raw)["files"]
            return {name for name in files if _plain(name)}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, TypeError, KeyError, RecursionError):
            return None

    def publish(self, manifest: bytes) -> None:
        """Put the manifest: on S3 only over the manifest read here (``If-Match`` its ETag, or
        ``If-None-Match: *`` where there is none). A try of an earlier save's put that S3
        receives late (its client gave up and retried) then fails there instead of replacing
        a newer manifest, which would name files this save deletes as replaced (a torn
        checkpoint) or bring back an older state.

        Raises:
            OSError: the put failed; ``EBUSY`` where the manifest changed since it was read
                (another write of this checkpoint landed): nothing of this save is published.
        """
        cond: dict[str, str] = {}
        if fsutil.conditional_puts(self.fs):
            # Read before the files it names: a change between the two fails the put below.
            cond = fsutil.put_conditions(self._call(f"check of {self.manifest_path}",
                                                    fsutil.current_etag, self.fs, self.manifest_path))
        self.replaced = self._manifest_files() or set()
        put = functools.partial(self.fs.pipe_file, self.manifest_path, manifest, **cond)
        error: BaseException | None = None
        for _ in range(2):
            try:
                self._call(f"put of {self.manifest_path}", put)
                return
            except BaseException as e:  # noqa: BLE001 - handled below, then raised
                error = e
                # 409: the put raced another write of the key (an earlier try of this one
                # still in flight); S3's advice is to put again: once, with the same condition.
                if not (cond and fsutil.write_conflict(e)):
                    break
        assert error is not None
        e = error
        gone = "IfMatch" in cond and isinstance(e, FileNotFoundError)  # removed meanwhile
        if cond and (fsutil.precondition_failed(e) or gone or fsutil.write_conflict(e)):
            held = self._call(f"read of {self.manifest_path}", self._holds, manifest)
            if held:
                return  # a try of this put landed before the one that answered
            if held is False and not fsutil.write_conflict(e):
                # Every try carries the condition, which no longer holds: none can land.
                raise OSError(errno.EBUSY, "the manifest changed while this save published "
                              "it (another write of this checkpoint landed first); not "
                              "published") from e
            if held is None:
                # Refused (412) or conflicting, and not read back: an earlier try may have
                # published it. Its files stay; the error says so.
                self.publish_in_flight = True
                raise OSError(errno.EIO, "the outcome of the manifest put is unknown: a try of "
                              f"it was refused ({type(e).__name__}: {e}) and the manifest could "
                              "not be read back to tell whether an earlier try published this "
                              "checkpoint; it may be published") from e
            # A try of it still in flight (409): it may land; its files stay (below).
        elif cond and fsutil.conditions_refused(e):
            fsutil.UNCONDITIONAL.add(self.fs)
            log.warning("gockpt: %s: the object store refused a conditional put (%s); "
                        "manifests go without If-Match from now on, so a late try of an "
                        "earlier save's put can land over a later save", self.root, e)
            try:
                self._call(f"put of {self.manifest_path}", self.fs.pipe_file,
                           self.manifest_path, manifest)
                return
            except BaseException:
                self.publish_in_flight = True
                raise
        # Whatever the last error says, an earlier try of the same put (s3fs and botocore
        # retry it) may have reached the store and land later, naming this save's files,
        # which must then stay: they are kept (a few objects leaked at worst).
        self.publish_in_flight = True
        raise e

    def _holds(self, manifest: bytes) -> bool | None:
        """Whether the manifest at the root is ``manifest`` (None: it could not be read)."""
        try:
            return storage.read_bounded(self.fs, self.manifest_path,
                                        max_bytes=storage.MAX_METADATA_BYTES) == manifest
        except FileNotFoundError:
            return False
        except Exception:  # noqa: BLE001 - unknown: the caller keeps the files
            return None

    def cleanup(self, published: bool) -> None:
        try:
            # One bound for the whole clean-up: its calls run on one worker thread, which goes
            # on in the background if the store hangs (the save's own outcome is not held up).
            self._call(f"clean-up after a save of {self.root}", self._cleanup, published)
        except TimeoutError as e:
            log.warning("gockpt: cleaning up after a save of %s: %s; it goes on in the "
                        "background, and objects of this save may be left behind", self.root, e)
        except Exception as e:  # noqa: BLE001 - never mask the save's own outcome
            log.warning("gockpt: cleaning up after a save of %s failed: %s", self.root, e)

    def _cleanup(self, published: bool) -> None:
        for f, path in self.failed:
            _abandon(f, path)
        ours = set(self.started)
        if published:
            doomed = self.replaced - ours
        elif self.publish_in_flight:
            # The put failed, but a try of it may land later and name our files.
            log.warning(
                "gockpt: the manifest put of %s failed and a try of it may still land: the %d "
                "object(s) of this save are kept", self.root, len(ours),
            )
            doomed = set()
        else:
            doomed = ours
        if doomed:
            paths = sorted(self.file_path(name) for name in doomed)
            try:
                self.fs.rm(paths)  # one bulk request on S3
            except FileNotFoundError:
                for path in paths:
                    fsutil.remove_file(self.fs, path)
            except Exception as e:  # noqa: BLE001 - reported, the save's error wins
                log.warning(
                    "gockpt: could not delete %d object(s) of a %s save of %s: %s: %s",
                    len(paths), "replaced" if published else "failed", self.root,
                    type(e).__name__, e,
                )
        if self.created_dir and not published:
            try:
                self.fs.rmdir(self.root)
            except Exception:  # noqa: BLE001 - many stores have no directories to remove
                pass


def _plain(name: object) -> bool:
    try:
        check_name(name, "")
    except ValueError:
        return False
    return True


def _abandon(f: Any, path: str) -> None:
    """Drop a half-written remote file without committing it where the backend allows
    (s3fs: ``discard()`` aborts the multipart upload)."""
    try:
        discard = getattr(f, "discard", None)
        if discard is not None:
            discard()
            f.closed = True  # a discarded buffered file must not flush on garbage collection
        else:
            f.close()
    except Exception as e:  # noqa: BLE001 - the caller deletes the object and re-raises
        log.warning("gockpt: could not discard the partial upload of %s: %s: %s",
                    path, type(e).__name__, e)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        False when the call or the flag is unsupported here (nothing changed).

    Raises:
        OSError: any other failure (nothing changed).
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)
