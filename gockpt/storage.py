"""A small storage surface over fsspec: locate checkpoints, the ``latest`` pointer, writer
claims, clean-up, and bounded reads of untrusted files.

Paths are ``str``: a local path or an fsspec URL (``memory://``, ``s3://``, ...), resolved with
:func:`url_to_fs`. A checkpoint is a directory holding shard files, a blob of non-tensor state
and ``manifest.json``; it is *complete* once its manifest is there and every file the manifest
names is there with the size it records. Beside the checkpoints, a pointer file ``latest`` names
the newest complete one (PCcheck §4.1: a pointer to the last fully persisted checkpoint, moved
only forward, so a valid checkpoint can be found at every instant). When the pointer is missing
or names a checkpoint that is not complete, :func:`latest_checkpoint` scans the manifests.

One process writes a directory at a time: :func:`claim_directory` takes a lock beside the
checkpoints (local: ``fcntl.flock`` on the folder; object stores: an owner object,
best effort) and refuses a second writer. Within a process the pointer is updated under a lock.

Scratch names (local only): ``.<name>.gockpt-tmp-<pid>-<hex>`` (staging directories, pointer
temp files, checkpoints being deleted) and ``.<name>.gockpt-old-<pid>-<hex>`` (a previous
checkpoint moved aside while publishing). A staging directory holds a lock file its writer keeps
``flock``-ed while writing, so :func:`cleanup_staging` can tell a dead writer from a live one in
any PID namespace.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from gockpt import _claim
from gockpt._claim import (
    DEFAULT_CLAIM_LEASE_S,
    OWNER_OBJECT_NAME,
    STAGING_LOCK_NAME,
    WRITER_LOCK_NAME,
    DirectoryClaim,
)
from gockpt._safe_read import open_local_regular, read_bounded
from gockpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    CheckpointTimeoutError,
)
from gockpt.format import decode_json
from gockpt.manifest import check_name, validate_manifest

__all__ = [
    "DEFAULT_CLAIM_LEASE_S",
    "DEFAULT_STORAGE_TIMEOUT_S",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "MAX_METADATA_BYTES",
    "OWNER_OBJECT_NAME",
    "STAGING_LOCK_NAME",
    "WRITER_LOCK_NAME",
    "DirectoryClaim",
    "advance_latest",
    "claim_directory",
    "cleanup_staging",
    "fsync_path",
    "is_complete",
    "is_local",
    "latest_checkpoint",
    "lock_staging",
    "open_local_regular",
    "read_bounded",
    "read_manifest",
    "remove_checkpoint",
    "storage_error",
    "unlock_staging",
    "url_to_fs",
]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
#: The largest ``manifest.json`` or ``latest`` pointer read, in bytes.
MAX_METADATA_BYTES = 16 << 20
#: Default bound on one object-store operation, in seconds (``GoCkptConfig.storage_timeout_s``).
DEFAULT_STORAGE_TIMEOUT_S = 60.0
#: Attempts per object-store request (botocore ``total_max_attempts``); s3fs's own retry loop
#: is turned off so attempts do not multiply.
S3_MAX_ATTEMPTS = 3

_SCRATCH_RE = re.compile(r"^\.(?P<name>.+)\.gockpt-(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]+$")

_LATEST_LOCK = threading.Lock()


def _reset_latest_lock_in_child() -> None:
    # Only the forking thread survives a fork: a lock another thread held stays held forever.
    global _LATEST_LOCK
    _LATEST_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_latest_lock_in_child)


def url_to_fs(
    path: str,
    storage_options: Mapping[str, Any] | None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> tuple[AbstractFileSystem, str]:
    """Resolve ``path`` to a filesystem and the path inside it, without a trailing slash.

    For ``s3://`` URLs, requests are bounded unless ``storage_options`` already sets them:
    botocore ``connect_timeout`` and ``read_timeout`` of ``timeout_s / S3_MAX_ATTEMPTS`` seconds
    and ``retries={"total_max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"}`` (which also
    backs off on ``503 SlowDown``), and s3fs's own retry loop off, so one request fails after
    about ``timeout_s`` seconds however the endpoint misbehaves. Options you set win.

    Args:
        path: local path or fsspec URL.
        storage_options: keyword arguments for the filesystem (credentials, endpoint, ...).
        timeout_s: bound on one object-store operation in seconds; None leaves the
            filesystem's own defaults (s3fs: 5 retries of up to 5 botocore attempts each).

    Returns:
        (filesystem, path in that filesystem); local paths come back absolute.
    """
    options = dict(storage_options or {})
    protocol = fsspec.core.split_protocol(path)[0]
    bounded_s3 = timeout_s is not None and protocol in ("s3", "s3a")
    if bounded_s3:
        config = dict(options.get("config_kwargs") or {})
        per_try = max(float(timeout_s) / S3_MAX_ATTEMPTS, 0.1)  # type: ignore[arg-type]
        config.setdefault("connect_timeout", per_try)
        config.setdefault("read_timeout", per_try)
        bounded_s3 = "retries" not in config
        config.setdefault("retries", {"total_max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"})
        options["config_kwargs"] = config
    fs, fs_path = fsspec.core.url_to_fs(path, **options)
    if bounded_s3 and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's loop around botocore's: one pass, botocore retries inside
    if len(fs_path) > 1:
        fs_path = fs_path.rstrip("/")
    return fs, fs_path


def is_local(fs: AbstractFileSystem) -> bool:
    """True if ``fs`` is the local filesystem (rename, fsync and flock are available)."""
    return isinstance(fs, LocalFileSystem)


def is_complete(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """True if the checkpoint at ``path`` is complete: its manifest is valid and every file it
    names is present with the size it records (a cheap stat per file, no checksums).

    A directory torn by a crash during deletion, or a manifest that does not decode, is not
    complete. Errors reaching the storage count as not complete.
    """
    fs, root = url_to_fs(path, storage_options)
    return _complete_manifest(fs, root) is not None


def latest_checkpoint(
    directory: str, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The newest complete checkpoint in ``directory``.

    The ``latest`` pointer names it. When the pointer is missing, or names a checkpoint that is
    no longer complete (a crash between publish and pointer update, a pointer write that hit
    ``ENOSPC``, a deleted checkpoint), the manifests of the directory's entries are scanned
    and the complete checkpoint with the highest captured step is returned.

    Args:
        directory: the directory holding checkpoints (local path or fsspec URL).
        storage_options: fsspec options.

    Returns:
        ``directory`` joined with the checkpoint's name (same URL form as ``directory``), or
        ``None`` if there is no complete checkpoint.

    Raises:
        CheckpointCorruptError: the pointer file is not a valid pointer (not a regular file,
            over 16 MiB, not JSON, wrong fields).
    """
    fs, parent = url_to_fs(directory, storage_options)
    pointer = _read_pointer(fs, parent, strict=True)
    if pointer is not None and _complete_manifest(fs, _join(parent, pointer["name"])):
        return _join_user(directory, pointer["name"])
    best = _best_checkpoint(fs, parent, exclude=None)
    return None if best is None else _join_user(directory, best[0])


def advance_latest(
    path: str,
    captured_step: int,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> bool:
    """Point ``latest`` (in the parent of ``path``) at the checkpoint ``path``.

    The pointer only moves forward: it is left alone when it names another complete checkpoint
    with a higher captured step (PCcheck §4.1). The file is replaced atomically: a temp file,
    fsync and ``os.replace`` locally, a single put on object stores.

    Args:
        path: a published checkpoint.
        captured_step: the optimizer step its tensors hold.
        storage_options: fsspec options.
        timeout_s: bound on one object-store operation in seconds (see :func:`url_to_fs`).

    Returns:
        True if the pointer now names ``path``.

    Raises:
        CheckpointStorageError: the pointer could not be written (``errno`` kept, e.g.
            ``ENOSPC``; the message names the pointer file and what became of it). A pointer
            naming an older checkpoint is then removed (unlinking needs no free space), so
            :func:`latest_checkpoint` scans and finds ``path``; if even that fails, it still
            names the older, valid checkpoint.
    """
    fs, root = url_to_fs(path, storage_options, timeout_s)
    parent, name = _split(root)
    with _LATEST_LOCK:
        current = _read_pointer(fs, parent, strict=False)
        if (
            current is not None
            and current["name"] != name
            and current["captured_step"] > captured_step
            and _complete_manifest(fs, _join(parent, current["name"])) is not None
        ):
            return False
        try:
            _write_pointer(fs, parent, {"name": name, "captured_step": int(captured_step)})
        except CheckpointStorageError as e:
            if current is None or current["name"] == name:
                raise
            # The pointer still names an older checkpoint. Without it, latest_checkpoint
            # scans the manifests and finds this newer one (unlinking needs no free space).
            pointer_path = _join(parent, LATEST_NAME)
            try:
                _remove_file(fs, pointer_path)
                state = "removed it; latest_checkpoint() finds the new checkpoint by scanning"
            except Exception:  # noqa: BLE001 - the older pointer is still a valid checkpoint
                state = f"it still names the older checkpoint {current['name']!r}"
            raise CheckpointStorageError(
                f"{e}; {state}", path=path, file=e.filename, errno=e.errno, strerror=e.strerror
            ) from e.__cause__
        return True


def remove_checkpoint(
    path: str,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> None:
    """Delete the checkpoint at ``path``, crash-safely; a symlink is unlinked, its target kept.

    If ``latest`` names it, the pointer is first moved to the complete checkpoint with the
    highest captured step left in the same directory, or deleted if there is none. Then the
    checkpoint stops being complete in one atomic step before any file goes: locally the
    directory is renamed to a scratch name (and the parent fsynced), then deleted; on object
    stores ``manifest.json`` is deleted first, then the rest. A crash at any moment leaves
    either the whole checkpoint or nothing that :func:`is_complete` accepts. A missing
    ``path`` is not an error.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        storage_options: fsspec options.
        timeout_s: bound on one object-store operation in seconds (see :func:`url_to_fs`).

    Raises:
        CheckpointStorageError: the pointer could be neither moved nor deleted (the checkpoint
            is then kept), or the storage failed; the message names the file.
    """
    fs, root = url_to_fs(path, storage_options, timeout_s)
    parent, name = _split(root)
    with _LATEST_LOCK:
        current = _read_pointer(fs, parent, strict=False)
        if current is not None and current["name"] == name:
            best = _best_checkpoint(fs, parent, exclude=name)
            try:
                if best is None:
                    _remove_file(fs, _join(parent, LATEST_NAME))
                else:
                    _write_pointer(fs, parent, {"name": best[0], "captured_step": best[1]})
            except CheckpointStorageError as e:
                # A pointer naming a missing checkpoint is recovered by scanning; one naming
                # the deleted checkpoint would be too, but deleting it is then our choice.
                try:
                    _remove_file(fs, _join(parent, LATEST_NAME))
                except Exception:
                    raise e from None
                log.warning("gockpt: %s; removed the 'latest' pointer instead", e)
    try:
        if is_local(fs):
            _remove_local_checkpoint(root)
        else:
            _remove_remote_checkpoint(fs, root)
    except CheckpointError:
        raise
    except Exception as e:
        raise storage_error(e, path, root, action="deleting checkpoint") from e


def cleanup_staging(directory: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Remove the local scratch entries in ``directory`` whose writer is provably gone.

    An entry is removed only when it is provably stale:

    - a staging directory holding a writer lock (``.gockpt-lock``) that this call can
      ``flock`` without blocking: the kernel released its writer's lock when the writer died,
      whatever its PID namespace or host (on a shared filesystem with working ``flock``);
    - an entry without a lock (pointer temp files, a checkpoint moved aside or being deleted,
      files of older versions) only while this process holds the directory's writer claim
      (:func:`claim_directory`; taken for the call if free, else such entries are kept), and
      only when the PID in its name is not this process's and is not alive here.

    A previous checkpoint moved aside during a publish (the fallback without an atomic
    exchange) is renamed back when nothing took its place, else deleted. Object stores have
    no staging: returns 0.

    Args:
        directory: the directory holding checkpoints.
        storage_options: fsspec options.

    Returns:
        The number of entries removed or restored.
    """
    fs, parent = url_to_fs(directory, storage_options)
    if not is_local(fs) or not os.path.isdir(parent):
        return 0
    entries = [(e, m) for e in os.listdir(parent) if (m := _SCRATCH_RE.match(e)) is not None]
    if not entries:
        return 0
    temp_claim: DirectoryClaim | None = None
    claimed = _claim.holds_local_claim(parent)
    if not claimed:
        try:
            temp_claim = claim_directory(parent, storage_options)
            claimed = True
        except CheckpointError:
            claimed = False  # another writer is alive here: keep what it may own
    count = 0
    try:
        for entry, match in entries:
            full = os.path.join(parent, entry)
            lock_path = os.path.join(full, STAGING_LOCK_NAME)
            lock: _claim.FileLock | None = None
            if os.path.isdir(full) and not os.path.islink(full) and os.path.lexists(lock_path):
                lock = _claim.FileLock.acquire(lock_path, create=False)
                if lock is None:
                    continue  # its writer holds the lock: alive
            else:
                pid = int(match["pid"])
                if not claimed or pid == os.getpid() or _pid_alive(pid):
                    continue
            try:
                target = os.path.join(parent, match["name"])
                if match["kind"] == "old" and not os.path.lexists(target):
                    os.rename(full, target)
                else:
                    _remove_local(full)
            finally:
                if lock is not None:
                    lock.release(unlink=False)  # the file went with its directory
            count += 1
        if count:
            fsync_path(parent)
    finally:
        if temp_claim is not None:
            temp_claim.release()
    return count


# --- writer claims (machinery in gockpt._claim) ------------------------------------------


def claim_directory(
    directory: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
    lease_s: float = DEFAULT_CLAIM_LEASE_S,
) -> DirectoryClaim:
    """Claim ``directory`` for this process's checkpoint writes; refuse if another writer has it.

    Local directories (created if missing): an exclusive ``fcntl.flock`` on the directory
    itself (nothing is added to it; where a filesystem cannot flock a directory, e.g. NFS, on a
    lock file ``<directory>/.gockpt-writer.lock``), held until the process's last claim on the
    directory is released, or the process ends. The kernel drops the lock of a process that died or was
    killed, so a run restarted in the same directory (Lightning ``ckpt_path="last"``) claims it
    at once. The lock spans PID namespaces (containers) on one host and hosts on filesystems
    whose ``flock`` is shared (NFSv4, CephFS, Lustre with ``flock``). The owner is recorded for
    error messages (extended attribute ``user.gockpt.writer``, or the lock file's content; the
    lock file is deleted on release).

    Object stores (best effort: the store has no lock): an owner object
    ``<directory>/.gockpt-writer.json`` with a random token, renewed every ``lease_s / 3``
    seconds by a daemon thread and deleted on release. An owner object of another writer is
    watched for up to ``lease_s`` seconds: renewed means alive (refused), unchanged means its
    writer is gone (taken over, with a warning). So a restart after a crash waits up to
    ``lease_s`` at its first save; two writers starting within one request's time of each
    other are not detected.

    Args:
        directory: the directory holding the checkpoints (and ``latest``).
        storage_options: fsspec options.
        timeout_s: bound on one object-store operation in seconds (see :func:`url_to_fs`).
        lease_s: object stores: how long an owner object stays valid without renewal, > 0.

    Returns:
        A :class:`DirectoryClaim`.

    Raises:
        CheckpointError: another process holds the directory; the message names the directory
            and the other owner (host, pid).
        CheckpointStorageError: the lock file or owner object cannot be written.
    """
    if lease_s <= 0:
        raise ValueError(f"lease_s must be > 0, got {lease_s}")
    fs, root = url_to_fs(directory, storage_options, timeout_s)
    try:
        return _claim.claim(directory, fs, root, lease_s)
    except CheckpointError:
        raise
    except Exception as e:
        raise storage_error(e, directory, directory, action="claiming directory") from e


def read_manifest(fs: AbstractFileSystem, root: str) -> dict:
    """Read and validate ``manifest.json`` of the checkpoint at ``root`` (size-bounded, strict
    JSON: no duplicate keys, bounded depth).

    Raises:
        FileNotFoundError: no manifest.
        CheckpointCorruptError: the manifest is hostile or malformed (names file and key).
    """
    manifest_path = _join(root, MANIFEST_NAME)
    raw = read_bounded(fs, manifest_path, max_bytes=MAX_METADATA_BYTES)
    return validate_manifest(decode_json(raw, manifest_path), manifest_path)


# --- errors ----------------------------------------------------------------------------------


def storage_error(
    e: BaseException, ckpt_path: str, file_path: str | None, *, action: str = "writing checkpoint"
) -> CheckpointError:
    """The error to raise for a storage failure ``e`` (use as ``raise storage_error(e) from e``).

    A :class:`CheckpointError` is returned as is; a timeout of any layer (``TimeoutError``,
    botocore/aiohttp timeouts) becomes a :class:`CheckpointTimeoutError`; anything else a
    :class:`CheckpointStorageError`. The message names the checkpoint, the file and the
    original error; ``errno`` is kept.
    """
    if isinstance(e, CheckpointError):
        return e
    code = e.errno if isinstance(e, OSError) else None
    strerror = e.strerror if isinstance(e, OSError) else None
    reason = strerror or str(e) or type(e).__name__
    prefix = f"[Errno {code}] " if code is not None else ""
    if not strerror:
        reason = f"{type(e).__name__}: {reason}" if str(e) else reason
    where = f"{action} {ckpt_path!r}" + (f", file {file_path!r}" if file_path else "")
    cls = CheckpointTimeoutError if _is_timeout(e) else CheckpointStorageError
    return cls(
        f"{prefix}{reason} ({where})", path=ckpt_path, file=file_path, errno=code,
        strerror=strerror,
    )


def _is_timeout(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


# --- private helpers shared by this package's persist and load stages ---------------------


def _join(parent: str, name: str) -> str:
    return f"{parent.rstrip('/')}/{name}" if parent != "/" else f"/{name}"


def _join_user(directory: str, name: str) -> str:
    if "://" in directory:
        return f"{directory.rstrip('/')}/{name}"
    return os.path.join(directory, name)


def _split(root: str) -> tuple[str, str]:
    parent, _, name = root.rpartition("/")
    if not name:
        raise ValueError(f"{root!r} is not a checkpoint path (it has no final name)")
    return parent or "/", name


def _complete_manifest(fs: AbstractFileSystem, root: str) -> dict | None:
    """The manifest of ``root`` if the checkpoint is complete (every named file there with its
    recorded size), else None."""
    try:
        manifest = read_manifest(fs, root)
        files = manifest["files"]
        if is_local(fs):
            for name, entry in files.items():
                st = os.stat(_join(root, name), follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size != entry["bytes"]:
                    return None
            return manifest
        fs.invalidate_cache(root)
        sizes = {
            str(info["name"]).rstrip("/").rpartition("/")[2]: info.get("size")
            for info in fs.ls(root, detail=True)
            if info.get("type", "file") == "file"
        }
        if all(sizes.get(name) == entry["bytes"] for name, entry in files.items()):
            return manifest
        return None
    except (OSError, CheckpointError, ValueError, TypeError, KeyError):
        return None


def fsync_path(path: str) -> None:
    """fsync a local file or directory (a directory's fsync makes renames in it durable).

    Raises:
        OSError: the path cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_local(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _remove_local_checkpoint(root: str) -> None:
    if os.path.islink(root) or (os.path.lexists(root) and not os.path.isdir(root)):
        os.unlink(root)
        return
    if not os.path.isdir(root):
        return
    parent, name = os.path.split(root)
    aside = os.path.join(parent, f".{name}.gockpt-tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        os.rename(root, aside)
    except OSError:
        # Cannot rename (a mount point, ...): the manifest goes first, durably.
        try:
            os.unlink(os.path.join(root, MANIFEST_NAME))
            fsync_path(root)
        except FileNotFoundError:
            pass
        shutil.rmtree(root)
        fsync_path(parent)
        return
    fsync_path(parent)
    shutil.rmtree(aside)


def _remove_remote_checkpoint(fs: AbstractFileSystem, root: str) -> None:
    # The manifest first: whatever a crash leaves after it is not complete.
    _remove_file(fs, _join(root, MANIFEST_NAME))
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass


def _remove_file(fs: AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _read_pointer(fs: AbstractFileSystem, parent: str, *, strict: bool) -> dict | None:
    pointer_path = _join(parent, LATEST_NAME)
    try:
        raw = read_bounded(fs, pointer_path, max_bytes=MAX_METADATA_BYTES)
        obj = decode_json(raw, pointer_path)
        if not isinstance(obj, dict):
            raise TypeError("not a JSON object")
        name, step = obj["name"], obj["captured_step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError("captured_step is not an integer")
        check_name(name, pointer_path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        if strict:
            raise CheckpointCorruptError(
                f"{pointer_path}: not a valid 'latest' pointer ({e})", path=pointer_path
            ) from None
        return None
    return {"name": name, "captured_step": step}


def _write_pointer(fs: AbstractFileSystem, parent: str, pointer: dict) -> None:
    """Replace ``latest`` atomically.

    Raises:
        CheckpointStorageError: naming the pointer file; the previous pointer is intact.
    """
    data = json.dumps(pointer).encode()
    target = _join(parent, LATEST_NAME)
    if not is_local(fs):
        try:
            fs.pipe_file(target, data)
        except Exception as e:
            raise storage_error(e, parent, target, action="updating 'latest' in") from e
        return
    tmp = os.path.join(parent, f".{LATEST_NAME}.gockpt-tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with fs.open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_path(parent)
    except BaseException as e:
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, Exception):
            raise storage_error(e, parent, target, action="updating 'latest' in") from e
        raise


def _captured_step(fs: AbstractFileSystem, root: str) -> int | None:
    manifest = _complete_manifest(fs, root)
    if manifest is None:
        return None
    step = manifest["meta"].get("captured_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _best_checkpoint(
    fs: AbstractFileSystem, parent: str, *, exclude: str | None
) -> tuple[str, int] | None:
    """The complete checkpoint in ``parent`` with the highest captured step (ties: by name)."""
    try:
        fs.invalidate_cache(parent)
        entries = fs.ls(parent, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    best: tuple[str, int] | None = None
    for entry in entries:
        name = entry.rstrip("/").rpartition("/")[2]
        if name in (exclude, LATEST_NAME) or name.startswith("."):
            continue
        step = _captured_step(fs, _join(parent, name))
        if step is not None and (best is None or (step, name) > (best[1], best[0])):
            best = (name, step)
    return best


def lock_staging(staging: str) -> Any:
    """Create and hold the writer lock of a local staging directory (see :func:`cleanup_staging`).

    Returns:
        An opaque handle for :func:`unlock_staging`.

    Raises:
        OSError: the lock file cannot be created.
    """
    return _claim.lock_staging(staging)


def unlock_staging(handle: Any, *, unlink: bool) -> None:
    """Release a staging lock; ``unlink`` deletes the lock file first (before a publish)."""
    if handle is not None:
        handle.release(unlink=unlink)
