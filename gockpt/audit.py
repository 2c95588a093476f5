"""Read-only checks of stored checkpoints: what one holds (``gockpt inspect``), whether every
file is intact (``gockpt verify``).

:func:`gockpt.load_checkpoint` checks the same sizes and checksums, but it stops at the first
bad file and brings everything into memory. :func:`verify_checkpoint` streams each file once
(for a progress bar), reports every bad file, and only then loads the checkpoint through the
loader, so "verified" means "loads".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from . import fsutil, storage
from ._safe_read import open_local_regular, require_directory
from .load import check_shard_header, framework_files, read_shard_header
from .manifest import by_file as manifest_by_file
from .manifest import is_part
from .errors import CheckpointCorruptError
from .format import CODE_TO_DTYPE, decode_json, dtype_itemsize

__all__ = ["Problem", "describe_checkpoint", "read_manifest", "require_intact", "verify_checkpoint"]

_READ_BYTES = 8 << 20


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        file: the file at fault (its path), or the checkpoint directory.
        message: what is wrong.
    """

    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"


def read_manifest(path: str, storage_options: Mapping[str, Any] | None = None) -> dict:
    """The validated manifest of the checkpoint at ``path``.

    Read by :func:`gockpt.storage.read_manifest`, the loader's own reader: at most
    ``storage.MAX_METADATA_BYTES`` (16 MiB) are read, locally only from a regular file that is
    not a symlink (a FIFO, device or link is refused without blocking), and the JSON is decoded
    strictly (no duplicate keys, bounded depth).

    Raises:
        FileNotFoundError: no ``manifest.json`` (no checkpoint, or an incomplete one).
        gockpt.CheckpointCorruptError: a manifest that is malformed, over the size bound, or not
            a regular file (names the file and field).
    """
    fs, root = storage.url_to_fs(path, storage_options)
    try:
        return storage.read_manifest(fs, root)
    except (FileNotFoundError, NotADirectoryError):
        what = "does not exist" if not fs.exists(root) else "is not a complete checkpoint"
        raise FileNotFoundError(f"{path} {what} (no {storage.MANIFEST_NAME})") from None


def describe_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> dict:
    """What the manifest of the checkpoint at ``path`` says, without reading any other file
    (of a sharded checkpoint, :mod:`gockpt.sharded`, also its parts' manifests: their files and
    tensors are listed as ``rank-<r>/<name>``).

    Returns:
        A JSON-able dict: ``path``, ``complete``, ``format_version``, ``requested_step``,
        ``captured_step``, ``mode``, ``num_overlap_steps``, ``created_unix_s``, ``replay``
        (backend, exact, max_abs_error), ``files`` (name -> bytes), ``total_bytes``,
        ``tensors`` (key -> dtype, shape, bytes, file), ``tensor_bytes``, ``aliases``,
        ``framework_files`` (a framework's own files, :func:`gockpt.load.framework_files`),
        ``part`` (one rank's part of a sharded checkpoint, not a checkpoint of its own), ``meta``.

    Raises:
        FileNotFoundError, gockpt.CheckpointCorruptError: as :func:`read_manifest`.
    """
    manifest = read_manifest(path, storage_options)
    meta = manifest["meta"]
    tensors = _tensors(manifest, "")
    files = {name: f["bytes"] for name, f in manifest["files"].items()}
    total = sum(files.values()) + len(json.dumps(manifest))
    replay = meta.get("replay") or {}
    created = meta.get("created_unix_s")
    if "sharded" in meta:
        from .sharded import part_name

        fs, root = storage.url_to_fs(path, storage_options)
        for r, name in enumerate(meta["sharded"].get("parts", [])):
            if name != part_name(r):  # also keeps every read inside the checkpoint
                raise CheckpointCorruptError(f"{path}/{storage.MANIFEST_NAME}: part {r} is {name!r}", path=path)
            if storage.is_local(fs):
                require_directory(fsutil.join(root, name))  # not a link out of the checkpoint
            part = read_manifest(fsutil.join_user(path, name), storage_options)
            tensors.update(_tensors(part, f"{name}/"))
            replay = replay or part["meta"].get("replay") or {}  # each part replays its own share
            if created is None:  # an index committed without its own time: its first part's
                created = part["meta"].get("created_unix_s")
            part_files = {f"{name}/{n}": f["bytes"] for n, f in part["files"].items()}
            files.update(part_files)
            total += sum(part_files.values()) + len(json.dumps(part))
    return {
        "path": path,
        "complete": True,
        "format_version": manifest["format_version"],
        "requested_step": meta.get("requested_step"),
        "captured_step": meta.get("captured_step"),
        "mode": meta.get("mode"),
        "num_overlap_steps": meta.get("num_overlap_steps"),
        "created_unix_s": created,
        "part": is_part(manifest),
        "replay": replay,
        "files": files,
        "total_bytes": total,
        "extra_file": manifest["extra_file"],
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors.values()),
        "aliases": manifest["aliases"],
        "framework_files": framework_files(manifest),
        "meta": meta,
    }


def _tensors(manifest: dict, prefix: str) -> dict:
    out = {}
    for key, entry in manifest["tensors"].items():
        numel = 1
        for s in entry["shape"]:
            numel *= s
        out[prefix + key] = {"dtype": entry["dtype"], "shape": entry["shape"], "file": prefix + entry["file"],
                             "bytes": numel * dtype_itemsize(CODE_TO_DTYPE[entry["dtype"]])}
    return out


def verify_checkpoint(
    path: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    load: bool = True,
    checksums: bool = True,
) -> list[Problem]:
    """Check every file of the checkpoint at ``path`` against its manifest.

    Per file: present, size, xxh3-64 checksum, and for shards the safetensors header against
    the manifest's tensor index. When all files pass and ``load`` is set, the checkpoint is
    loaded by :func:`gockpt.load_checkpoint` (without checksums again) to prove it decodes.
    A sharded checkpoint (:mod:`gockpt.sharded`) has each part's manifest checked against the
    index and each part verified the same way; it is loaded by :func:`gockpt.dcp.load_full`.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        storage_options: fsspec options.
        progress: called with the number of bytes read, as they are read.
        load: load the checkpoint once the files pass.
        checksums: read every file whole for its checksum; False checks presence, kind, size
            and shard headers only (reads a header's bytes).

    Returns:
        The problems found, empty when the checkpoint is intact.

    Raises:
        FileNotFoundError: no checkpoint, or no manifest (an incomplete checkpoint).
        gockpt.CheckpointCorruptError: the manifest itself is malformed.
    """
    manifest = read_manifest(path, storage_options)
    fs, root = storage.url_to_fs(path, storage_options)
    by_file = manifest_by_file(manifest)
    problems = []
    for name, entry in manifest["files"].items():
        file_path = fsutil.join(root, name)
        # Shards are the files holding tensors; a writer's other files get their checksum only
        # (a framework's own safetensors file too: Accelerate's model.safetensors written from
        # the weights its save_state pre-hooks left, which no tensor index lists).
        is_shard = name in by_file or (name.endswith(".safetensors") and name != manifest["extra_file"]
                                       and not manifest["meta"].get("writer"))
        problem = _check_file(fs, file_path, entry, by_file.get(name, {}), is_shard, progress,
                              checksums)
        if problem is not None:
            problems.append(Problem(file_path, problem))
    sharded = "sharded" in manifest["meta"]
    if sharded and not problems:  # the index is intact: check the parts it names
        problems += _verify_parts(fs, root, path, storage_options, progress)
    # A framework's folder layout (Accelerate's) is read by its own loader, not gockpt's.
    if not problems and load and not framework_files(manifest):
        from .dcp import load_full
        from .restore import load_checkpoint

        try:
            if sharded:
                load_full(path, verify=False)
            else:
                load_checkpoint(path, storage_options=storage_options, verify=False)
        except Exception as e:  # noqa: BLE001 - reported as a problem of this checkpoint
            problems.append(Problem(path, f"does not load: {type(e).__name__}: {e}"))
    return problems


def require_intact(path: str, storage_options: Mapping[str, Any] | None = None, *,
                   checksums: bool = True) -> None:
    """:func:`verify_checkpoint` of ``path``'s files (not loaded), raising on the first problem.

    Raises:
        FileNotFoundError: no manifest at ``path``.
        gockpt.CheckpointCorruptError: naming the first bad file and how many more there are.
    """
    problems = verify_checkpoint(path, storage_options, load=False, checksums=checksums)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointCorruptError(f"{problems[0].file}: {problems[0].message}{more}", path=path)


def _verify_parts(fs: Any, root: str, path: str, storage_options: Mapping[str, Any] | None,
                  progress: Callable[[int], None] | None) -> list[Problem]:
    """Each part of a sharded checkpoint: its manifest against the index, then its files."""
    from .sharded import INDEX_FILE, part_name

    index_path = fsutil.join(root, INDEX_FILE)
    try:  # read as untrusted: a regular file, bounded, strict JSON
        index = decode_json(storage.read_bounded(fs, index_path,
                                                 max_bytes=storage.MAX_METADATA_BYTES), index_path)
        parts = index["parts"]
        if not isinstance(parts, list):
            raise TypeError("'parts' is not a list")
    except (OSError, ValueError, TypeError, KeyError) as e:
        return [Problem(index_path, f"not a valid index: {e}")]
    problems = []
    for r, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("name") != part_name(r):
            # also keeps every read inside the checkpoint
            problems.append(Problem(index_path, f"part {r} is {part!r}"))
            continue
        if not (isinstance(part.get("manifest_bytes"), int)
                and isinstance(part.get("manifest_xxh3_64"), str)):
            problems.append(Problem(index_path, f"part {r}: malformed manifest size or checksum"))
            continue
        entry = {"bytes": part["manifest_bytes"], "xxh3_64": part["manifest_xxh3_64"]}
        if storage.is_local(fs):
            try:
                require_directory(fsutil.join(root, part["name"]))
            except (OSError, CheckpointCorruptError) as e:
                problems.append(Problem(fsutil.join(root, part["name"]), str(e)))
                continue
        manifest_path = fsutil.join(fsutil.join(root, part["name"]), storage.MANIFEST_NAME)
        problem = _check_file(fs, manifest_path, entry, {}, False, progress)
        if problem is not None:
            problems.append(Problem(manifest_path, problem))
            continue
        problems += verify_checkpoint(fsutil.join_user(path, part["name"]), storage_options,
                                      progress=progress, load=False)
    return problems


def _check_file(
    fs: Any, file_path: str, entry: dict, index: dict[str, dict], is_shard: bool,
    progress: Callable[[int], None] | None, checksums: bool = True,
) -> str | None:
    if fsutil.is_local(fs):
        # Only a regular file inside the checkpoint is read: no symlink out, FIFO or device.
        try:
            os.close(open_local_regular(file_path)[0])
        except (FileNotFoundError, NotADirectoryError):
            return "missing (listed in the manifest)"
        except CheckpointCorruptError as e:
            return str(e).removeprefix(f"{file_path}: ")  # the problem names the file
    try:
        size = fs.size(file_path)
    except (FileNotFoundError, NotADirectoryError):
        return "missing (listed in the manifest)"
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
    if not checksums and not is_shard:
        return None
    with fs.open(file_path, "rb") as f:
        if checksums:
            hasher = xxhash.xxh3_64()
            while chunk := f.read(_READ_BYTES):
                hasher.update(chunk)
                if progress is not None:
                    progress(len(chunk))
            if hasher.hexdigest() != entry["xxh3_64"]:
                return f"xxh3-64 checksum {hasher.hexdigest()} does not match the manifest ({entry['xxh3_64']})"
        if not is_shard:
            return None
        head = read_shard_header(f, size)
    try:
        check_shard_header(file_path, head, size, index)
    except ValueError as e:
        return str(e).removeprefix(f"{file_path}: ")
    return None
