"""A small storage surface over fsspec: locate checkpoints, the ``latest`` pointer, clean up.

Paths are ``str``: a local path or an fsspec URL (``memory://``, ``s3://``, ...), resolved with
:func:`fsspec.core.url_to_fs`. A checkpoint is a directory holding shard files, a blob of
non-tensor state and ``manifest.json``; it exists only once its manifest does. Beside the
checkpoints, a pointer file ``latest`` names the newest complete one (PCcheck §4.1: a pointer
to the last fully persisted checkpoint, moved only forward, so a valid checkpoint can be found
at every instant).

The pointer is updated under a process-wide lock; concurrent writers in *other* processes
must not share a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from gockpt.format import CheckpointCorruptError
from gockpt.manifest import check_name

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"

# Local scratch names: ``.<name>.gockpt-tmp-<pid>-<hex>`` (staging dirs, pointer temp files)
# and ``.<name>.gockpt-old-<pid>-<hex>`` (a previous checkpoint moved aside while publishing).
_SCRATCH_RE = re.compile(r"^\.(?P<name>.+)\.gockpt-(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]+$")

_LATEST_LOCK = threading.Lock()


def url_to_fs(
    path: str, storage_options: Mapping[str, Any] | None
) -> tuple[AbstractFileSystem, str]:
    """Resolve ``path`` to a filesystem and the path inside it, without a trailing slash.

    Args:
        path: local path or fsspec URL.
        storage_options: keyword arguments for the filesystem (credentials, endpoint, ...).

    Returns:
        (filesystem, path in that filesystem); local paths come back absolute.
    """
    fs, fs_path = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
    if len(fs_path) > 1:
        fs_path = fs_path.rstrip("/")
    return fs, fs_path


def is_local(fs: AbstractFileSystem) -> bool:
    """True if ``fs`` is the local filesystem (rename and fsync are available)."""
    return isinstance(fs, LocalFileSystem)


def is_complete(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """True if a checkpoint at ``path`` has its manifest, i.e. was published completely."""
    fs, root = url_to_fs(path, storage_options)
    return _has_manifest(fs, root)


def latest_checkpoint(
    directory: str, storage_options: Mapping[str, Any] | None = None
) -> str | None:
    """The checkpoint named by the ``latest`` pointer in ``directory``.

    Args:
        directory: the directory holding checkpoints (local path or fsspec URL).
        storage_options: fsspec options.

    Returns:
        ``directory`` joined with the pointer's name (same URL form as ``directory``), or
        ``None`` if there is no pointer or the checkpoint it names is not complete.

    Raises:
        CheckpointCorruptError: the pointer file is not a valid pointer.
    """
    fs, parent = url_to_fs(directory, storage_options)
    pointer = _read_pointer(fs, parent, strict=True)
    if pointer is None or not _has_manifest(fs, _join(parent, pointer["name"])):
        return None
    return _join_user(directory, pointer["name"])


def advance_latest(
    path: str, captured_step: int, storage_options: Mapping[str, Any] | None = None
) -> bool:
    """Point ``latest`` (in the parent of ``path``) at the checkpoint ``path``.

    The pointer only moves forward: it is left alone when it names another checkpoint with a
    higher captured step that still exists and is complete (PCcheck §4.1). The file is replaced
    atomically: a temp file, fsync and ``os.replace`` locally, a single put on object stores.

    Args:
        path: a published checkpoint.
        captured_step: the optimizer step its tensors hold.
        storage_options: fsspec options.

    Returns:
        True if the pointer now names ``path``.
    """
    fs, root = url_to_fs(path, storage_options)
    parent, name = _split(root)
    with _LATEST_LOCK:
        current = _read_pointer(fs, parent, strict=False)
        if (
            current is not None
            and current["name"] != name
            and current["captured_step"] > captured_step
            and _has_manifest(fs, _join(parent, current["name"]))
        ):
            return False
        _write_pointer(fs, parent, {"name": name, "captured_step": int(captured_step)})
        return True


def remove_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete the checkpoint at ``path``; a symlink is unlinked, its target left alone.

    If ``latest`` names it, the pointer is first moved to the complete checkpoint with the
    highest captured step left in the same directory, or deleted if there is none, so it never
    names a checkpoint that is being removed. A missing ``path`` is not an error.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        storage_options: fsspec options.
    """
    fs, root = url_to_fs(path, storage_options)
    parent, name = _split(root)
    with _LATEST_LOCK:
        current = _read_pointer(fs, parent, strict=False)
        if current is not None and current["name"] == name:
            best = _best_checkpoint(fs, parent, exclude=name)
            if best is None:
                _remove_file(fs, _join(parent, LATEST_NAME))
            else:
                _write_pointer(fs, parent, {"name": best[0], "captured_step": best[1]})
    if is_local(fs):
        _remove_local(root)
    elif fs.exists(root):
        fs.rm(root, recursive=True)


def cleanup_staging(directory: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Remove the local scratch entries left in ``directory`` by processes that died.

    Staging directories and pointer temp files of dead processes are deleted. A previous
    checkpoint moved aside during a publish (the fallback without an atomic exchange) is
    renamed back when nothing took its place, else deleted. Entries of live processes,
    this one included, are kept. Object stores have no staging: returns 0.

    Args:
        directory: the directory holding checkpoints.
        storage_options: fsspec options.

    Returns:
        The number of entries removed or restored.
    """
    fs, parent = url_to_fs(directory, storage_options)
    if not is_local(fs) or not os.path.isdir(parent):
        return 0
    count = 0
    for entry in os.listdir(parent):
        match = _SCRATCH_RE.match(entry)
        if match is None or _pid_alive(int(match["pid"])):
            continue
        full = os.path.join(parent, entry)
        target = os.path.join(parent, match["name"])
        if match["kind"] == "old" and not os.path.lexists(target):
            os.rename(full, target)
        else:
            _remove_local(full)
        count += 1
    if count:
        fsync_path(parent)
    return count


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


def _has_manifest(fs: AbstractFileSystem, root: str) -> bool:
    return bool(fs.exists(_join(root, MANIFEST_NAME)))


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
        raw = fs.cat_file(pointer_path)
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw)
        name, step = obj["name"], obj["captured_step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError("captured_step is not an integer")
        check_name(name, pointer_path)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        if strict:
            raise CheckpointCorruptError(
                f"{pointer_path}: not a valid 'latest' pointer ({e})"
            ) from None
        return None
    return {"name": name, "captured_step": step}


def _write_pointer(fs: AbstractFileSystem, parent: str, pointer: dict) -> None:
    data = json.dumps(pointer).encode()
    target = _join(parent, LATEST_NAME)
    if not is_local(fs):
        fs.pipe_file(target, data)
        return
    tmp = os.path.join(parent, f".{LATEST_NAME}.gockpt-tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(parent)


def _captured_step(fs: AbstractFileSystem, root: str) -> int | None:
    try:
        manifest = json.loads(fs.cat_file(_join(root, MANIFEST_NAME)))
        step = manifest["meta"]["captured_step"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _best_checkpoint(
    fs: AbstractFileSystem, parent: str, *, exclude: str
) -> tuple[str, int] | None:
    try:
        entries = fs.ls(parent, detail=False)
    except FileNotFoundError:
        return None
    best: tuple[str, int] | None = None
    for entry in entries:
        name = entry.rstrip("/").rpartition("/")[2]
        if name in (exclude, LATEST_NAME) or name.startswith("."):
            continue
        step = _captured_step(fs, _join(parent, name))
        if step is not None and (best is None or step > best[1]):
            best = (name, step)
    return best
