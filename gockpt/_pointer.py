"""Completeness and the ``latest`` pointer: the machinery behind :func:`gockpt.storage.is_complete`,
:func:`~gockpt.storage.latest_checkpoint`, :func:`~gockpt.storage.advance_latest` and
:func:`~gockpt.storage.remove_checkpoint`.

The pointer is a JSON object ``{"name": ..., "captured_step": ..., "run": ...}`` in the file
``latest`` beside the checkpoints. Checkpoints are ordered by the run that wrote them, then by
captured step (saves of one run may finish out of order: PCcheck §4.1). ``run`` (in the pointer
and in each manifest's ``meta``) orders runs: the writing engine's start (wall clock, ns), raised
above the newest run already in the directory at its first save there (a resumed run comes after
the run it resumed, whatever their steps or the clocks of their hosts); a load into a live
engine starts a new run. 0: unknown (converted, or written by 0.1.0), before any other.

Callers that read and then rewrite the pointer hold :data:`LATEST_LOCK`, read as
``_pointer.LATEST_LOCK`` at the time of use (a forked child gets a fresh lock object).
"""

from __future__ import annotations

import json
import os
import stat
import threading
from typing import Any

from fsspec import AbstractFileSystem

from gockpt._bounded import DEFAULT_STORAGE_TIMEOUT_S
from gockpt._safe_read import read_bounded
from gockpt.errors import CheckpointCorruptError, CheckpointError
from gockpt.format import decode_json
from gockpt.fsutil import MANIFEST_NAME, fsync_path, is_local, join, scratch_path, storage_error
from gockpt.manifest import check_name, is_part, validate_manifest

LATEST_NAME = "latest"
#: The largest ``manifest.json`` or ``latest`` pointer read, in bytes.
MAX_METADATA_BYTES = 16 << 20

#: Serialises read-modify-write of ``latest`` within this process.
LATEST_LOCK = threading.Lock()


def _reset_latest_lock_in_child() -> None:
    # Only the forking thread survives a fork: a lock another thread held stays held forever.
    global LATEST_LOCK
    LATEST_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_latest_lock_in_child)


def read_manifest(fs: AbstractFileSystem, root: str, *,
                  timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S) -> dict:
    """Read and validate ``manifest.json`` of the checkpoint at ``root`` (size-bounded, strict
    JSON: no duplicate keys, bounded depth); ``timeout_s`` bounds the read on a store that may
    hang (:func:`gockpt._safe_read.read_bounded`).

    Raises:
        FileNotFoundError: no manifest.
        CheckpointCorruptError: the manifest is hostile or malformed (names file and key).
        TimeoutError: the store did not answer within ``timeout_s``.
    """
    manifest_path = join(root, MANIFEST_NAME)
    raw = read_bounded(fs, manifest_path, max_bytes=MAX_METADATA_BYTES, timeout_s=timeout_s)
    return validate_manifest(decode_json(raw, manifest_path), manifest_path)


def complete_manifest(fs: AbstractFileSystem, root: str) -> dict | None:
    """The manifest of ``root`` if the checkpoint is complete (every named file there with its
    recorded size), else None."""
    try:
        manifest = read_manifest(fs, root)
        files = manifest["files"]
        if is_local(fs):
            for name, entry in files.items():
                st = os.stat(join(root, name), follow_symlinks=False)
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


#: The largest ``run`` (a signed 64-bit integer, for JSON readers other than Python's).
MAX_RUN = (1 << 63) - 1


def run_of(meta: Any) -> int:
    """The ``run`` of a manifest's ``meta`` (see the module doc); 0 where absent or not an int
    in ``[0, MAX_RUN]`` (:func:`gockpt.manifest.validate_manifest` refuses those)."""
    v = meta.get("run") if isinstance(meta, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_RUN else 0


def newest_run(fs: AbstractFileSystem, parent: str) -> int:
    """The ``run`` of the newest checkpoint in ``parent``: its pointer's, else (none, or not a
    valid pointer) a scan's; 0 for none.

    Raises:
        CheckpointStorageError: reading the pointer or listing failed (a timeout included).
    """
    try:
        pointer = read_pointer(fs, parent, strict=True)
    except CheckpointCorruptError:
        pointer = None
    if pointer is not None:
        return pointer["run"]
    best = best_checkpoint(fs, parent, exclude=None)
    return 0 if best is None else best[2]


def read_pointer(fs: AbstractFileSystem, parent: str, *, strict: bool) -> dict | None:
    """The pointer in ``parent`` as ``{"name", "captured_step", "run"}`` (the last 0
    in a pointer written before runs were recorded), or None if there is none.

    Raises:
        CheckpointCorruptError: ``strict`` and the pointer is not valid (else None).
        CheckpointStorageError: ``strict`` and reading it failed (else None); a timeout of the
            store is a :class:`gockpt.CheckpointTimeoutError`.
    """
    pointer_path = join(parent, LATEST_NAME)
    try:
        raw = read_bounded(fs, pointer_path, max_bytes=MAX_METADATA_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except CheckpointCorruptError:  # not a regular file, too large
        if strict:
            raise
        return None
    except Exception as e:  # noqa: BLE001 - the storage failed (a timeout, a refused connection)
        if strict:  # not a bad pointer: a caller must not take a healthy one for damaged
            raise storage_error(e, parent, pointer_path, action="reading 'latest' in") from e
        return None
    try:
        obj = decode_json(raw, pointer_path)
        if not isinstance(obj, dict):
            raise TypeError("not a JSON object")
        name, step, run = obj["name"], obj["captured_step"], obj.get("run", 0)
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError("captured_step is not an integer")
        if not isinstance(run, int) or isinstance(run, bool) or not 0 <= run <= MAX_RUN:
            raise TypeError("run is not an integer in [0, 2**63)")
        check_name(name, pointer_path)
    except (ValueError, TypeError, KeyError) as e:
        if strict:
            raise CheckpointCorruptError(
                f"{pointer_path}: not a valid 'latest' pointer ({e})", path=pointer_path
            ) from None
        return None
    return {"name": name, "captured_step": step, "run": run}


def write_pointer(fs: AbstractFileSystem, parent: str, pointer: dict,
                  conditions: dict[str, str] | None = None) -> None:
    """Replace ``latest`` atomically; on an object store with ``conditions`` (S3's
    ``IfMatch``/``IfNoneMatch``, :func:`gockpt.fsutil.put_conditions`) only over that pointer.

    Raises:
        CheckpointStorageError: naming the pointer file; the previous pointer is intact.
    """
    data = json.dumps(pointer).encode()
    target = join(parent, LATEST_NAME)
    if not is_local(fs):
        try:
            fs.pipe_file(target, data, **(conditions or {}))
        except Exception as e:
            raise storage_error(e, parent, target, action="updating 'latest' in") from e
        return
    tmp = scratch_path(parent, LATEST_NAME)
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


def _order(fs: AbstractFileSystem, root: str) -> tuple[int, int] | None:
    """``(run, captured_step)`` of the complete checkpoint at ``root``, or None."""
    manifest = complete_manifest(fs, root)
    if manifest is None or is_part(manifest):  # a part of a sharded checkpoint cut short
        return None
    step = manifest["meta"].get("captured_step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return run_of(manifest["meta"]), step


def best_checkpoint(
    fs: AbstractFileSystem, parent: str, *, exclude: str | None
) -> tuple[str, int, int] | None:
    """``(name, captured_step, run)`` of the newest complete checkpoint in ``parent``: of the
    latest run, the highest captured step (ties: by name)."""
    try:
        fs.invalidate_cache(parent)
        entries = fs.ls(parent, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    best: tuple[str, int, int] | None = None
    for entry in entries:
        name = entry.rstrip("/").rpartition("/")[2]
        # "latest" is scanned too: a checkpoint of that name (update_latest=False) is one; the
        # pointer file holds no manifest.
        if name == exclude or name.startswith("."):
            continue
        order = _order(fs, join(parent, name))
        if order is not None and (best is None or (*order, name) > (best[2], best[1], best[0])):
            best = (name, order[1], order[0])
    return best
