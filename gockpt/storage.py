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

The low-level helpers (paths, fsync, deletion, storage errors) live in :mod:`gockpt.fsutil`,
the completeness and pointer machinery in ``gockpt._pointer``; this module is the API on top.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gockpt import _claim, _pointer, fsutil
from gockpt._bounded import bounded_fs
from gockpt._claim import (
    DEFAULT_CLAIM_LEASE_S,
    OWNER_OBJECT_NAME,
    STAGING_LOCK_NAME,
    WRITER_LOCK_NAME,
    DirectoryClaim,
)
from gockpt._pointer import (
    LATEST_NAME,
    MAX_RUN,
    best_checkpoint,
    complete_manifest,
    read_manifest,
    read_pointer,
    write_pointer,
)
from gockpt._safe_read import open_local_regular, read_bounded
from gockpt.errors import CheckpointCorruptError, CheckpointError, CheckpointStorageError
from gockpt.fsutil import (
    BACKGROUND_DELETE_BYTES,
    MANIFEST_NAME,
    SCRATCH_RE,
    bounded_call,
    call_bound,
    check_replaceable,
    fsync_path,
    is_local,
    join,
    join_user,
    remove_file,
    remove_local,
    remove_local_checkpoint,
    remove_remote_checkpoint,
    split,
    storage_error,
    tree_bytes,
    url_to_fs,
)

__all__ = [
    "DEFAULT_CLAIM_LEASE_S",
    "BackgroundDeleter",
    "ClaimedStaging",
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
    "check_save_path",
    "checkpoint_number",
    "cleanup_staging",
    "fsync_path",
    "is_complete",
    "is_local",
    "latest_checkpoint",
    "lock_staging",
    "newest_run",
    "numbered_checkpoints",
    "open_local_regular",
    "prune_numbered",
    "read_bounded",
    "read_manifest",
    "remove_checkpoint",
    "storage_error",
    "unlock_staging",
    "url_to_fs",
]

_NUMBER = re.compile(r"([0-9]+)")

log = logging.getLogger(__name__)

# Assigned here rather than only imported so these keep their doc comments in this module.
#: The largest ``manifest.json`` or ``latest`` pointer read, in bytes.
MAX_METADATA_BYTES = _pointer.MAX_METADATA_BYTES
#: Default bound on one object-store operation, in seconds (``GoCkptConfig.storage_timeout_s``).
DEFAULT_STORAGE_TIMEOUT_S = fsutil.DEFAULT_STORAGE_TIMEOUT_S
#: Attempts per object-store request (botocore ``total_max_attempts``); s3fs's own retry loop
#: is turned off so attempts do not multiply.
S3_MAX_ATTEMPTS = fsutil.S3_MAX_ATTEMPTS


def check_save_path(path: str, *, update_latest: bool,
                    framework_names: re.Pattern[str] | None = None) -> None:
    """Refuse a save to ``path`` (as :func:`gockpt.fsutil.path_key` spells it) that would
    destroy what is not a checkpoint, or clash with GoCkpt's own names; at the request, before
    anything is copied. Object stores replace only the files a manifest names, so only local
    directories are looked at.

    Raises:
        ValueError: the checkpoint's name is ``latest`` while the ``latest`` pointer beside it
            is kept (``update_latest``), or a scratch name that clean-up deletes
            (:data:`gockpt.fsutil.SCRATCH_RE`).
        FileExistsError: a local directory that is not empty and holds no checkpoint, nor only
            entries ``framework_names`` matches (:func:`gockpt.fsutil.check_replaceable`).
    """
    name = split(path)[1]
    if update_latest and name == LATEST_NAME:
        raise ValueError(f"gockpt: {path}: the name {LATEST_NAME!r} is the pointer to the newest "
                         "checkpoint in that folder; name the checkpoint otherwise, or set "
                         "update_latest=False")
    if SCRATCH_RE.match(name):
        raise ValueError(f"gockpt: {path}: a name of GoCkpt's scratch entries, which clean-up "
                         "deletes; name the checkpoint otherwise")
    if "://" not in path:
        check_replaceable(path, framework_names)


def is_complete(path: str, storage_options: Mapping[str, Any] | None = None,
                timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S) -> bool:
    """True if the checkpoint at ``path`` is complete: its manifest is valid and every file it
    names is present with the size it records (a cheap stat per file, no checksums).

    A directory torn by a crash during deletion, or a manifest that does not decode, is not
    complete. Errors reaching the storage count as not complete, and so does a call into a
    store that may hang (not local, not S3) not answered within ``timeout_s`` seconds.
    """
    fs, root = url_to_fs(path, storage_options, timeout_s)
    return complete_manifest(bounded_fs(fs, timeout_s), root) is not None


def has_manifest(path: str, storage_options: Mapping[str, Any] | None = None,
                 timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S) -> bool:
    """Whether ``path`` holds an entry named ``manifest.json`` (locally of any kind, a symlink
    or FIFO included), complete or not: the manifest is written last, so a checkpoint that has
    one and is not complete (:func:`is_complete`) is damaged rather than cut short. Errors
    reaching the storage count as none, and so does a store that may hang (not local, not S3)
    not answering within ``timeout_s`` seconds. Raises nothing."""
    try:
        fs, root = url_to_fs(path, storage_options, timeout_s)
        target = join(root, MANIFEST_NAME)
        return os.path.lexists(target) if is_local(fs) else bool(bounded_fs(fs, timeout_s).exists(target))
    except Exception:  # noqa: BLE001 - unreachable storage: no verdict of damage
        return False


def latest_checkpoint(
    directory: str, storage_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> str | None:
    """The newest complete checkpoint in ``directory``.

    The ``latest`` pointer names it. When the pointer is missing, or names a checkpoint that is
    no longer complete (a crash between publish and pointer update, a pointer write that hit
    ``ENOSPC``, a deleted checkpoint), the manifests of the directory's entries are scanned
    and the newest complete checkpoint is returned: of the latest run (``run`` in its
    manifest; a resumed run is later than the one it resumed), the highest captured step.

    Args:
        directory: the directory holding checkpoints (local path or fsspec URL).
        storage_options: fsspec options.
        timeout_s: bound on one object-store operation in seconds (see :func:`url_to_fs`).

    Returns:
        ``directory`` joined with the checkpoint's name (same URL form as ``directory``), or
        ``None`` if there is no complete checkpoint.

    Raises:
        CheckpointCorruptError: the pointer file is not a valid pointer (not a regular file,
            over 16 MiB, not JSON, wrong fields). A complete checkpoint named ``latest`` is
            not taken for one: the entries are scanned.
        CheckpointStorageError: reading the pointer or listing the directory failed in the
            store (a :class:`CheckpointTimeoutError` where it timed out: on a store that may hang, not
            local and not S3, each call of the lookup, a scan of the manifests included, is
            waited for at most ``timeout_s`` seconds): not a verdict on the pointer.
    """
    fs, parent = url_to_fs(directory, storage_options, timeout_s)
    fs = bounded_fs(fs, timeout_s)
    what = "finding the newest checkpoint in"
    try:
        return _timeout_named(directory, what, lambda: _latest(fs, directory, parent))
    except CheckpointError:
        raise
    except Exception as e:
        # The store's own errors (a failed LIST of the scan: botocore's, or s3fs's OSError)
        # as GoCkpt's, naming the directory.
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise
        if isinstance(e, OSError) or type(e).__module__.partition(".")[0] in _STORE_MODULES:
            raise storage_error(e, directory, directory, action=what) from e
        raise


#: Packages whose exceptions are an object store's failures (raised through s3fs).
_STORE_MODULES = frozenset({"botocore", "aiobotocore", "aiohttp"})


def _latest(fs: Any, directory: str, parent: str) -> str | None:
    try:
        pointer = read_pointer(fs, parent, strict=True)
    except CheckpointCorruptError:
        # A checkpoint named "latest" (saved with update_latest=False) is no pointer: scan.
        if complete_manifest(fs, join(parent, LATEST_NAME)) is None:
            raise
        pointer = None
    if pointer is not None and complete_manifest(fs, join(parent, pointer["name"])):
        return join_user(directory, pointer["name"])
    best = best_checkpoint(fs, parent, exclude=None)
    return None if best is None else join_user(directory, best[0])


def _bounded(fs: Any, timeout_s: float | None, path: str, what: str, fn: Callable[[], Any],
             *, scale: float = 1.0, serial: bool = False) -> Any:
    """``fn()`` (calls into ``fs``), waited for at most ``scale * timeout_s`` where ``fs`` may
    hang (:func:`gockpt.fsutil.call_bound`); a timeout raises :class:`CheckpointTimeoutError`
    naming ``path``. Calls made under ``LATEST_LOCK`` go through here: an abandoned call runs
    on without the lock. ``serial``: calls that change the pointer, run in order (a write
    abandoned past its bound may land later, but never after a newer one)."""
    bound = call_bound(fs, timeout_s)
    return _timeout_named(path, what, lambda: bounded_call(fn, None if bound is None else bound * scale, what,
                                                           serial=serial))


def _timeout_named(path: str, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, a ``TimeoutError`` of it raised as a :class:`CheckpointTimeoutError` naming ``path``."""
    try:
        return fn()
    except TimeoutError as e:
        if isinstance(e, CheckpointError):
            raise
        raise storage_error(e, path, path, action=what) from e


def newest_run(
    directory: str,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> int:
    """The ``run`` (:mod:`gockpt._pointer`) of the newest checkpoint in ``directory``: its
    ``latest`` pointer's, else the newest complete checkpoint's found by a scan; 0 when there
    is none (or the directory does not exist). At most :data:`MAX_RUN`.

    Raises:
        CheckpointStorageError: the store failed or did not answer within ``timeout_s``
            seconds (per call; a scan reads one manifest per entry).
    """
    fs, parent = url_to_fs(directory, storage_options, timeout_s)
    fs = bounded_fs(fs, timeout_s)
    return _timeout_named(directory, "finding the newest run in",
                          lambda: min(MAX_RUN, _pointer.newest_run(fs, parent)))


def advance_latest(
    path: str,
    captured_step: int,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
    *,
    run: int = 0,
) -> bool:
    """Point ``latest`` (in the parent of ``path``) at the checkpoint ``path``.

    The pointer only moves forward: it is left alone when it names another complete checkpoint
    of a later run, or of the same run with a higher captured step (saves of one run may end out
    of order: PCcheck §4.1); where there is no pointer, when the directory holds such a
    checkpoint (a scan). A resumed run's checkpoints come after those of the run it resumed,
    whatever their steps (an optimizer without state resumes at step 0; a run restarted from an
    earlier checkpoint goes on from there). The file is replaced atomically: a temp file, fsync
    and ``os.replace`` locally, a single put on object stores.

    Args:
        path: a published checkpoint.
        captured_step: the optimizer step its tensors hold.
        storage_options: fsspec options.
        timeout_s: bound on one object-store operation in seconds (see :func:`url_to_fs`).
        run: the run that wrote it (its manifest's ``meta["run"]``; see
            :mod:`gockpt._pointer`); 0 orders it before every recorded run.

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
    parent, name = split(root)
    what = "updating 'latest' in"

    def bounded(fn: Callable[[], Any], serial: bool = False, scale: float = 1.0) -> Any:
        return _bounded(fs, timeout_s, path, what, fn, serial=serial, scale=scale)

    with _pointer.LATEST_LOCK:  # looked up per call: a forked child replaces it
        # On S3 the pointer is put only over the one read here: a late try of an earlier
        # put (its client gave up and retried) is refused rather than moving it back. Where
        # the put finds it changed, what is there now is read and decided on again.
        for _ in range(_POINTER_TRIES):
            moved = _advance_once(fs, parent, name, path, int(captured_step), int(run), bounded)
            if moved is not None:
                return moved
        raise CheckpointStorageError(
            f"the 'latest' pointer in {parent!r} changed under every one of {_POINTER_TRIES} "
            "conditional puts (another writer?); it was left as that writer left it "
            "(latest_checkpoint() scans the manifests where it names no complete checkpoint)",
            path=path, file=join(parent, LATEST_NAME))


#: Conditional puts of ``latest`` that may find it changed before one is given up.
_POINTER_TRIES = 3


def _advance_once(fs: Any, parent: str, name: str, path: str, captured_step: int, run: int,
                  bounded: Callable[..., Any]) -> bool | None:
    """One decision and put of :func:`advance_latest`; None: the pointer changed under a
    conditional put (decide again)."""
    conditional = fsutil.conditional_puts(fs)
    target = join(parent, LATEST_NAME)
    etag = bounded(lambda: fsutil.current_etag(fs, target)) if conditional else None
    current = bounded(lambda: read_pointer(fs, parent, strict=False))
    if (
        current is not None
        and current["name"] != name
        and (current["run"], current["captured_step"]) > (run, captured_step)
        and bounded(lambda: complete_manifest(fs, join(parent, current["name"]))) is not None
    ):
        return False
    if current is None:
        # No pointer (a first save here, or one removed after a failed write): a later
        # checkpoint may be there all the same (a save of this run that ended first).
        # Readers scan without a pointer, and find that one.
        best = bounded(lambda: best_checkpoint(fs, parent, exclude=name), scale=4.0)
        if best is not None and (best[2], best[1]) > (run, captured_step):
            return False
    pointer = {"name": name, "captured_step": captured_step, "run": run}
    conditions = fsutil.put_conditions(etag) if conditional else None
    try:
        bounded(lambda: write_pointer(fs, parent, pointer, conditions), serial=True)
    except CheckpointStorageError as e:
        # 412: changed since read; 409: a write of it in flight; 404 under If-Match: removed.
        gone = conditions is not None and "IfMatch" in conditions and (
            e.errno == errno.ENOENT or isinstance(e.__cause__, FileNotFoundError))
        if conditions and (fsutil.precondition_failed(e) or fsutil.write_conflict(e) or gone):
            now = bounded(lambda: read_pointer(fs, parent, strict=False))
            return True if now is not None and now["name"] == name else None
        if conditions and fsutil.conditions_refused(e):
            fsutil.UNCONDITIONAL.add(fs)
            log.warning("gockpt: %s: the object store refused a conditional put of 'latest' "
                        "(%s); it is put without a condition from now on", parent, e)
            return None
        if current is None or current["name"] == name:
            raise
        # The pointer still names an older checkpoint. Without it, latest_checkpoint
        # scans the manifests and finds this newer one (unlinking needs no free space).
        try:
            bounded(lambda: remove_file(fs, target), serial=True)
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
    *,
    discard: Callable[[str], None] | None = None,
) -> None:
    """Delete the checkpoint at ``path``, crash-safely; a symlink is unlinked, its target kept.

    If ``latest`` names it, the pointer is first moved to the newest complete checkpoint left in
    the same directory (of the latest run, the highest captured step), or deleted if there is
    none. Then the checkpoint stops being complete in one atomic step before any file goes:
    locally the directory is renamed to a scratch name (and the parent fsynced), then deleted;
    on object stores ``manifest.json`` is deleted first, then the rest. A crash at any moment leaves
    either the whole checkpoint or nothing that :func:`is_complete` accepts. A missing
    ``path`` is not an error.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        storage_options: fsspec options.
        timeout_s: bound on one object-store operation in seconds (see :func:`url_to_fs`).
        discard: locally, deletes the files of the checkpoint once it is renamed aside (see
            :func:`gockpt.fsutil.remove_local_checkpoint`); None: this call deletes them.

    Raises:
        CheckpointStorageError: the pointer could be neither moved nor deleted (the checkpoint
            is then kept), or the storage failed; the message names the file.
    """
    fs, root = url_to_fs(path, storage_options, timeout_s)
    parent, name = split(root)
    what = "removing checkpoint"

    def bounded(fn: Callable[[], Any], scale: float = 1.0, serial: bool = False) -> Any:
        return _bounded(fs, timeout_s, path, what, fn, scale=scale, serial=serial)

    with _pointer.LATEST_LOCK:
        current = bounded(lambda: read_pointer(fs, parent, strict=False))
        if current is not None and current["name"] == name:
            # A scan reads one manifest per entry: a few bounds' worth.
            best = bounded(lambda: best_checkpoint(fs, parent, exclude=name), scale=4.0)
            try:
                # On S3 the pointer is deleted, not moved back: a late try of a put naming the
                # older checkpoint could land over a later save's pointer, where a late delete
                # only makes readers scan (and the next save puts it anew).
                if best is None or fsutil.conditional_puts(fs):
                    bounded(lambda: remove_file(fs, join(parent, LATEST_NAME)), serial=True)
                else:
                    bounded(lambda: write_pointer(fs, parent, {"name": best[0],
                                                               "captured_step": best[1],
                                                               "run": best[2]}),
                            serial=True)
            except CheckpointStorageError as e:
                # A pointer naming a missing checkpoint is recovered by scanning; one naming
                # the deleted checkpoint would be too, but deleting it is then our choice.
                try:
                    bounded(lambda: remove_file(fs, join(parent, LATEST_NAME)), serial=True)
                except Exception:
                    raise e from None
                log.warning("gockpt: %s; removed the 'latest' pointer instead", e)
    try:
        if is_local(fs):
            remove_local_checkpoint(root, discard)
        else:
            # The manifest goes first: a deletion abandoned part-way leaves nothing complete.
            bounded(lambda: remove_remote_checkpoint(fs, root), scale=4.0)
    except CheckpointError:
        raise
    except Exception as e:
        raise storage_error(e, path, root, action="deleting checkpoint") from e


class ClaimedStaging:
    """Staging directories beside local checkpoints, in parent directories this process claims.

    The first staging directory made in a parent claims it (one writer per directory,
    :func:`claim_directory`) and removes what dead writers left there (:func:`cleanup_staging`).
    Used by writers that publish a staging directory themselves (sharded and staged commits).

    Args:
        storage_options: fsspec options; timeout_s: bound on one storage operation (seconds).
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None,
                 timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S) -> None:
        self.storage_options, self.timeout_s = storage_options, timeout_s
        self._claims: dict[str, DirectoryClaim] = {}

    def make(self, root: str) -> str:
        """Make and return an empty staging directory for the local checkpoint ``root``.

        Raises:
            CheckpointError: another process holds the parent directory (:func:`claim_directory`).
            CheckpointStorageError, OSError: the claim or the directory could not be made.
        """
        parent, name = split(root)
        if parent not in self._claims:
            self._claims[parent] = claim_directory(parent, self.storage_options, timeout_s=self.timeout_s)
            cleanup_staging(parent, self.storage_options)
        stage = fsutil.scratch_path(parent, name)
        os.mkdir(stage)
        return stage

    def release(self) -> None:
        """Release every claim (the staging directories are the caller's)."""
        claims, self._claims = list(self._claims.values()), {}
        for c in claims:
            c.release()


class BackgroundDeleter:
    """Deletes checkpoint trees already renamed aside: a large one on a thread, a small one at once.

    Pass it as ``remove_checkpoint(..., discard=deleter)``. The checkpoint leaves its path in the
    call either way; unlinking the files of a large one (:data:`gockpt.fsutil.BACKGROUND_DELETE_BYTES`
    or more) takes the kernel long enough to stall a training step, so that happens on a thread
    of this object's, in order. A small tree is deleted at once, so nothing is left beside the
    checkpoints while it goes. A deletion that fails is logged; the scratch name it has left is
    :func:`cleanup_staging`'s.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __call__(self, aside: str) -> None:
        if tree_bytes(aside) < BACKGROUND_DELETE_BYTES:
            _delete_aside(aside)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="gockpt-delete")
            self._pool.submit(_delete_aside, aside)

    def drain(self) -> None:
        """Wait until every tree handed over so far is deleted."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.submit(lambda: None).result()  # one thread, in order: every earlier one is done

    def close(self) -> None:
        """:meth:`drain`, then stop the thread (a later tree starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _delete_aside(path: str) -> None:
    try:
        remove_local(path)
    except OSError as e:
        log.warning("gockpt: could not delete %s (cleanup_staging will): %s", path, e)


def checkpoint_number(name: str) -> int | None:
    """The number of a numbered checkpoint name: its first run of digits (``checkpoint_12`` -> 12),
    the order Accelerate's automatic naming uses; None without digits."""
    m = _NUMBER.search(name)
    return int(m.group(1)) if m else None


def numbered_checkpoints(directory: str) -> list[str]:
    """Names in local ``directory`` with a :func:`checkpoint_number`, oldest (lowest) first.

    Hidden names (staging, scratch) are left out; a missing directory has none.
    """
    if not os.path.isdir(directory):
        return []
    pairs = [(number, name) for name in os.listdir(directory)
             if not name.startswith(".") and (number := checkpoint_number(name)) is not None]
    return [name for _, name in sorted(pairs)]


def prune_numbered(directory: str, keep: int) -> list[str]:
    """Delete the oldest numbered checkpoints in local ``directory`` beyond the newest ``keep``.

    Each goes through :func:`remove_checkpoint` (renamed aside first), so a crash leaves whole
    checkpoints only. Call it after a publish: the newest checkpoint is already in place
    (PCcheck §4.1: no old checkpoint is touched before the new one is complete). The newest is
    always kept, whatever ``keep``: Accelerate's ``total_limit`` of 0 or less deletes the older
    ones before each save and keeps the one it writes.

    Returns:
        The names deleted, oldest first.

    Raises:
        CheckpointStorageError: a deletion failed (naming the file); the rest are kept.
    """
    names = numbered_checkpoints(directory)
    doomed = names[: max(0, len(names) - max(1, keep))]
    for name in doomed:
        remove_checkpoint(os.path.join(directory, name))
    return doomed


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
    entries = [(e, m) for e in os.listdir(parent) if (m := SCRATCH_RE.match(e)) is not None]
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
                    remove_local(full)
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
        return _claim.claim(directory, fs, root, lease_s, timeout_s)
    except CheckpointError:
        raise
    except Exception as e:
        raise storage_error(e, directory, directory, action="claiming directory") from e


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
