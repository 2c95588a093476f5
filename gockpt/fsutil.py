"""Low-level filesystem helpers shared by GoCkpt's storage, persist, load, audit and convert.

Nothing here knows about the ``latest`` pointer or writer claims (see :mod:`gockpt.storage`):
resolving a path to an fsspec filesystem, joining and splitting paths inside one, fsync,
deletions that tolerate a missing path, crash-safe deletion of a checkpoint directory, scratch
names, calls into a filesystem that may hang bounded in time (:func:`bounded_call`), and turning
a storage failure into a :class:`~gockpt.errors.CheckpointError`.

Paths inside a filesystem (what :func:`url_to_fs` returns) use ``/`` and carry no protocol.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import sys
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from gockpt._bounded import DEFAULT_STORAGE_TIMEOUT_S, bounded_call, call_bound, is_local
from gockpt.errors import CheckpointError, CheckpointStorageError, CheckpointTimeoutError

__all__ = [
    "BACKGROUND_DELETE_BYTES",
    "DEFAULT_STORAGE_TIMEOUT_S",
    "MANIFEST_NAME",
    "S3_MAX_ATTEMPTS",
    "GOCKPT_NAMES",
    "SCRATCH_RE",
    "bounded_call",
    "call_bound",
    "check_replaceable",
    "fsync_path",
    "is_local",
    "join",
    "join_user",
    "path_key",
    "remove_file",
    "remove_local",
    "remove_local_checkpoint",
    "remove_remote_checkpoint",
    "scratch_path",
    "split",
    "storage_error",
    "tree_bytes",
    "url_to_fs",
]

#: The file a save writes last; its presence makes a checkpoint complete, so deletion removes
#: it first.
MANIFEST_NAME = "manifest.json"
#: Attempts per object-store request (botocore ``total_max_attempts``); s3fs's own retry loop
#: is turned off so attempts do not multiply.
S3_MAX_ATTEMPTS = 3
#: A local scratch entry's name, as :func:`scratch_path` makes it: groups ``name`` (the entry
#: it stands for), ``kind`` (``tmp`` or ``old``) and ``pid`` (the process that made it).
SCRATCH_RE = re.compile(r"^\.(?P<name>.+)\.gockpt-(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]+$")


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


# --- paths -----------------------------------------------------------------------------------


def join(parent: str, name: str) -> str:
    """``parent/name`` for a path inside a filesystem (as :func:`url_to_fs` returns it).

    Always joins with ``/`` (object stores use it locally too); a trailing ``/`` of ``parent`` is
    dropped, and ``parent == "/"`` gives ``/name``. Raises nothing.
    """
    return f"{parent.rstrip('/')}/{name}" if parent != "/" else f"/{name}"


def join_user(directory: str, name: str) -> str:
    """``directory/name`` in the form the user gave ``directory``: an fsspec URL is joined with
    ``/`` (protocol kept), a local path with :func:`os.path.join`. Raises nothing."""
    if "://" in directory:
        return f"{directory.rstrip('/')}/{name}"
    return os.path.join(directory, name)


def split(root: str) -> tuple[str, str]:
    """Split a path inside a filesystem into (parent, final name); the parent of ``/x`` is ``/``.

    Raises:
        ValueError: ``root`` has no final name (empty, or ends with ``/``).
    """
    parent, _, name = root.rpartition("/")
    if not name:
        raise ValueError(f"{root!r} is not a checkpoint path (it has no final name)")
    return parent or "/", name


def path_key(path: str | os.PathLike[str]) -> str:
    """One key per checkpoint directory, however ``path`` spells it (str, no I/O beyond
    resolving the parent's symlinks).

    The key is taken when it is asked for. :meth:`gockpt.Engine.save` takes it at the request
    and writes to the key itself, so a ``chdir`` or a re-pointed parent symlink before the
    persist runs changes neither where the checkpoint lands nor which saves it supersedes.

    A local path (plain, ``~``-relative, or ``file://``/``local://``) becomes absolute with
    its parent's symlinks and ``.`` and ``..`` segments resolved as the filesystem resolves
    them: ``ckpt/last``, ``./ckpt/last`` and ``/run/ckpt/last`` name one directory. The last
    component is kept as written: a checkpoint directory that is itself a symlink stays its own
    name. A URL of any other protocol only loses its trailing ``/``: object-store keys are not
    resolved.

    Raises:
        TypeError: ``path`` is neither a str nor an ``os.PathLike`` of one.
    """
    path = os.fspath(path)
    for prefix in ("file://", "local://", "file:", "local:"):  # local, as fsspec reads them
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    else:
        if "://" in path:
            return path.rstrip("/") or path
    # fsspec expands a leading "~" of a local path, so "~/ckpt" is the home's, not "./~/ckpt".
    local = os.path.expanduser(path)
    local = local.rstrip("/") or local
    parent, name = os.path.split(local)
    if name in ("", ".", ".."):
        return os.path.realpath(local)
    return os.path.join(os.path.realpath(parent or "."), name)


#: Entries GoCkpt itself puts in a checkpoint directory (shards, the pickled rest, manifests,
#: a sharded checkpoint's index, parts and markers, a folder writer's sidecar); a directory left
#: half-deleted or half-copied by a crash holds only these.
GOCKPT_NAMES = re.compile(
    r"manifest\.json|shard-[0-9a-z-]+\.safetensors|state-[0-9a-f]+\.pt|sharded\.json"
    r"|rank-\d+(\.sharding\.json|\.done|\.failed|\.captured)?|gockpt\.json")
_GOCKPT_FORMAT = re.compile(rb'"format"\s*:\s*"gockpt')
_MAX_MANIFEST_PROBE = 64 << 20


_CHECK_ATTEMPTS = 20


def check_replaceable(root: str, framework_names: re.Pattern[str] | None = None) -> None:
    """Refuse to replace the local entry ``root`` unless it is a checkpoint's or nothing's.

    A save publishes by swapping its staging directory into ``root`` and deleting what was
    there. That is meant for a file or a symlink (replaced, never written through, as stock
    Lightning replaces ``last.ckpt``), nothing, or a directory whose every entry is one GoCkpt
    writes (:data:`GOCKPT_NAMES`: a checkpoint, an empty placeholder made at a request, what a
    crash left of one) or one ``framework_names`` matches (a checkpoint the framework wrote
    itself, which its own save would overwrite:
    :attr:`gockpt.writer.CheckpointWriter.framework_names`); a ``manifest.json`` there must be
    a regular file of GoCkpt's format. Any other directory holds someone's files (``"."``, the
    folder of all checkpoints, a project or dataset folder, files added to a checkpoint's
    folder), which a save must never delete.

    Raises:
        FileExistsError: ``root`` is a directory (not a symlink to one) holding another entry,
            or a ``manifest.json`` that is not GoCkpt's; the message names it and a few of
            those entries.
        OSError: ``root`` or its entries cannot be read.
    """
    # A save of the same path still publishing (``last.ckpt`` saved at every step) swaps a new
    # directory in while this looks: the look counts only if ``root`` is the same directory
    # before and after it, else it is taken again.
    for attempt in range(_CHECK_ATTEMPTS + 1):
        last = attempt == _CHECK_ATTEMPTS  # swapped at every look: the last one decides
        try:
            before = os.lstat(root)
            if not stat.S_ISDIR(before.st_mode):
                return
            foreign = sorted(n for n in os.listdir(root) if not GOCKPT_NAMES.fullmatch(n)
                             and not (framework_names is not None and framework_names.fullmatch(n)))
            foreign_manifest = not foreign and _foreign_manifest(os.path.join(root, MANIFEST_NAME))
            if last or (foreign_manifest is not None and os.path.samestat(before, os.lstat(root))):
                break
        except FileNotFoundError:  # moved aside by a publish without an atomic exchange
            if last:
                return
    if not foreign and foreign_manifest is False:
        return
    what = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "") or \
        f"a {MANIFEST_NAME} of another format"
    raise FileExistsError(
        errno.EEXIST, f"gockpt: {root} is a directory that is not a checkpoint (it holds "
        f"{what}); a save there would replace it whole. Save to another path, or remove it "
        "first", root)


def _foreign_manifest(path: str) -> bool | None:
    """Whether ``path`` exists and is not a manifest of GoCkpt's: a regular file (read as
    untrusted: :func:`gockpt._safe_read.open_local_regular`), at most 64 MiB, naming the
    ``gockpt`` format. Only its first 4 KiB are read where the format is named there (GoCkpt's
    manifests name it first). None: replaced while it was being opened (look again)."""
    from gockpt._safe_read import ReplacedWhileOpenedError, open_local_regular

    try:
        fd, size = open_local_regular(path)
    except FileNotFoundError:
        return False
    except ReplacedWhileOpenedError:
        return None
    except (OSError, CheckpointError):  # a symlink, a FIFO, unreadable: not ours
        return True
    with os.fdopen(fd, "rb") as f:
        if size > _MAX_MANIFEST_PROBE:
            return True
        head = f.read(4096)
        return (_GOCKPT_FORMAT.search(head) is None
                and _GOCKPT_FORMAT.search(head + f.read(_MAX_MANIFEST_PROBE)) is None)


def scratch_path(parent: str, name: str, kind: str = "tmp") -> str:
    """A fresh local scratch path ``<parent>/.<name>.gockpt-<kind>-<pid>-<hex>`` standing for
    ``name`` (matched by :data:`SCRATCH_RE`, so :func:`gockpt.storage.cleanup_staging` removes
    it once this process is gone).

    Args:
        parent: the local directory the entry goes in.
        name: the entry it stands for.
        kind: ``"tmp"`` (being written or deleted) or ``"old"`` (a previous checkpoint moved
            aside, restored by clean-up when nothing took its place).

    Raises:
        ValueError: ``kind`` is neither ``"tmp"`` nor ``"old"``.
    """
    if kind not in ("tmp", "old"):
        raise ValueError(f"scratch kind must be 'tmp' or 'old', got {kind!r}")
    return os.path.join(parent, f".{name}.gockpt-{kind}-{os.getpid()}-{uuid.uuid4().hex}")


# --- durability and deletion -----------------------------------------------------------------


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


def remove_local(path: str) -> None:
    """Delete a local file, symlink (not its target) or directory tree; a missing path is fine.

    Not crash-safe for checkpoints (see :func:`remove_local_checkpoint`), and nothing is fsynced.

    Raises:
        OSError: the deletion failed (permissions, a busy mount, ...).
    """
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
        return
    # Another thread may add or rename a file meanwhile (a part's marker written through a
    # temporary name): a file gone before its unlink is fine, and a file made after the listing
    # is removed by another pass.
    for attempt in range(3):
        if not os.path.isdir(path):
            return
        try:
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=_gone_is_fine)
            else:
                shutil.rmtree(path, onerror=lambda f, p, info: _gone_is_fine(f, p, info[1]))
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY or attempt == 2:
                raise


def _gone_is_fine(_func: Any, _path: str, exc: BaseException) -> None:
    if not isinstance(exc, FileNotFoundError):
        raise exc


def remove_file(fs: AbstractFileSystem, path: str) -> None:
    """Delete one file of ``fs``; a missing file is fine.

    Raises:
        Exception: whatever ``fs.rm_file`` raises other than ``FileNotFoundError``.
    """
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


BACKGROUND_DELETE_BYTES = 64 << 20
"""Trees at least this large (bytes) are worth deleting on a thread (see :func:`tree_bytes`)."""


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under local ``path`` (symlinks not followed)."""
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(d, n))
            except FileNotFoundError:
                continue
            total += st.st_size
    return total


def remove_local_checkpoint(root: str, discard: Callable[[str], None] | None = None) -> None:
    """Delete the local checkpoint directory ``root`` so that it stops being complete in one
    durable step before any file goes; a symlink (or other non-directory) is unlinked, its
    target kept; a missing ``root`` is fine.

    The directory is renamed to a scratch name (:func:`scratch_path`), the parent fsynced, then
    the scratch tree deleted (a crash leaves it to :func:`gockpt.storage.cleanup_staging`).
    Where it cannot be renamed (a mount point, ...), ``manifest.json`` is unlinked and ``root``
    fsynced first, then the rest deleted.

    Args:
        root: the checkpoint directory.
        discard: deletes the renamed scratch tree instead of this call (e.g. on a background
            thread: unlinking gigabytes takes the kernel a while); ``root`` is gone when this
            call returns either way.

    Raises:
        OSError: a rename, unlink, fsync or deletion failed.
    """
    try:  # one look: the entry may go meanwhile (a placeholder's own clean-up)
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            os.unlink(root)
            return
    except FileNotFoundError:
        return
    parent, name = os.path.split(root)
    aside = scratch_path(parent, name)
    try:
        os.rename(root, aside)
    except FileNotFoundError:
        return  # removed meanwhile (an empty placeholder its save's own clean-up took)
    except OSError:
        # Cannot rename (a mount point, ...): the manifest goes first, durably.
        try:
            os.unlink(os.path.join(root, MANIFEST_NAME))
            fsync_path(root)
        except FileNotFoundError:
            pass
        remove_local(root)
        fsync_path(parent)
        return
    fsync_path(parent)
    if discard is None:
        shutil.rmtree(aside)
    else:
        discard(aside)


def remove_remote_checkpoint(fs: AbstractFileSystem, root: str) -> None:
    """Delete the checkpoint at ``root`` of an object store: ``manifest.json`` first (whatever a
    crash leaves after it is not complete), then the rest; a missing ``root`` is fine.

    Raises:
        Exception: whatever ``fs`` raises other than ``FileNotFoundError``.
    """
    # The manifest first: whatever a crash leaves after it is not complete.
    remove_file(fs, join(root, MANIFEST_NAME))
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass


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


def conditional_puts(fs: AbstractFileSystem) -> bool:
    """Whether puts to ``fs`` take S3's conditions (``If-Match``, ``If-None-Match``): s3fs,
    unless its store refused them once (:data:`UNCONDITIONAL`)."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return bool({"s3", "s3a"} & set(protocol)) and fs not in UNCONDITIONAL


#: Filesystems whose store refused a conditional put: their manifests go without conditions.
UNCONDITIONAL: weakref.WeakSet[AbstractFileSystem] = weakref.WeakSet()


def current_etag(fs: AbstractFileSystem, path: str) -> str | None:
    """The ETag of the object at ``path`` now, read from the store, not a cached listing
    (None: there is none)."""
    fs.invalidate_cache(path)
    try:
        return fs.info(path)["ETag"]
    except FileNotFoundError:
        return None


def put_conditions(etag: str | None) -> dict[str, str]:
    """The put arguments that make it land only over the object of ``etag`` (None: over none)."""
    return {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """``e`` and what it was raised from or during (s3fs raises its own error from botocore's)."""
    seen = 0
    while e is not None and seen < 20:
        yield e
        e = e.__cause__ or e.__context__
        seen += 1


def _answered(e: BaseException | None, code: str, status: int) -> bool:
    """Whether the store answered the request of ``e`` with error ``code`` or HTTP ``status``."""
    for x in _chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict) and (response.get("Error", {}).get("Code") == code
                                           or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == status):
            return True
    return False


def precondition_failed(e: BaseException | None) -> bool:
    """Whether ``e`` is S3's answer that a put's condition failed (``412 PreconditionFailed``)."""
    return _answered(e, "PreconditionFailed", 412)


def write_conflict(e: BaseException | None) -> bool:
    """Whether ``e`` is S3's ``409 ConditionalRequestConflict``: a conditional put raced
    another write of the same key (an earlier try of it, still in flight); what is there is
    not settled yet, so the put's outcome is unknown."""
    return _answered(e, "ConditionalRequestConflict", 409)


def conditions_refused(e: BaseException | None) -> bool:
    """Whether ``e`` says the store (or an older botocore) does not take a put's conditions:
    ``501 NotImplemented`` (S3 before 2024, S3-compatible stores), botocore's parameter
    validation of ``IfMatch``/``IfNoneMatch``."""
    return _answered(e, "NotImplemented", 501) or any(
        type(x).__name__ == "ParamValidationError" and ("IfMatch" in str(x) or "IfNoneMatch" in str(x))
        for x in _chain(e))
