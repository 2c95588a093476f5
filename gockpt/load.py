"""Read a checkpoint directory back: manifest, shards (checked against it), extra state.

The directory is untrusted. Only regular files inside it are opened (locally: no symlink, in
or out of the directory, no device, no FIFO); every size is bounded before reading (the
manifest to 16 MiB, every other file to the size the manifest records, a shard header to its
file); JSON is decoded strictly (no duplicate keys, bounded depth). Every file is size-checked
and, with ``verify``, checksummed in the same pass that brings it into memory. Local shards are
memory-mapped copy-on-write from the descriptor that was checked, so tensors share pages with
the page cache and writing to them never changes the file (tensors under 64 KiB are copied into
storage of their own); remote shards are read piece by piece straight into each tensor's own
storage (a shard is held once plus a piece).
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import xxhash
from fsspec import AbstractFileSystem

from gockpt import _safe_read, fsutil, storage
from gockpt.errors import CheckpointCorruptError, CheckpointError
from gockpt.format import CODE_TO_DTYPE, MAX_HEADER_BYTES, decode_header
from gockpt.manifest import by_file as manifest_by_file

#: Local tensors smaller than this (bytes) are copied out of the shard mapping.
OWN_STORAGE_BYTES = 64 << 10


@dataclass
class LoadedCheckpoint:
    """What :func:`read_checkpoint` returns.

    Attributes:
        tensors: key -> CPU tensor; an alias key maps to the very tensor object of its target.
        extra: the non-tensor state, as ``torch.load`` returns it.
        manifest: the validated manifest (``manifest["meta"]`` holds the engine's metadata).
    """

    tensors: dict[str, torch.Tensor]
    extra: Any
    manifest: dict


def read_checkpoint(
    path: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = True,
    allow_pickle: bool = False,
    timeout_s: float | None = storage.DEFAULT_STORAGE_TIMEOUT_S,
) -> LoadedCheckpoint:
    """Load the checkpoint directory at ``path``.

    Args:
        path: local path or fsspec URL of the checkpoint directory.
        storage_options: fsspec options.
        verify: compare every file's xxh3-64 checksum with the manifest (sizes, headers and
            the tensor index are checked regardless).
        allow_pickle: load the extra state with full pickle instead of ``weights_only=True``;
            only for checkpoints you trust.
        timeout_s: bound on one read call in seconds, on a store whose calls may hang (not
            local, not S3, whose requests botocore bounds): files are read in pieces of
            :data:`gockpt._safe_read.READ_PIECE_BYTES`, each answered within it. None: unbounded.

    Returns:
        A :class:`LoadedCheckpoint` whose tensors are CPU tensors that stay valid after the
        call (local ones backed by private memory maps of the shard files).

    Raises:
        FileNotFoundError: no ``manifest.json`` at ``path`` (missing or incomplete checkpoint).
        ValueError: a sharded checkpoint (:mod:`gockpt.sharded`): see :mod:`gockpt.dcp`; or a
            framework's folder layout (``meta.writer``: Accelerate's ``save_state`` folder).
        CheckpointCorruptError: malformed manifest, wrong format or version, a file name
            escaping the directory, a missing file, a size or checksum mismatch, a shard header
            disagreeing with the manifest, an undecodable extra blob; the message names the
            file and, where one is at fault, the tensor key.
        CheckpointStorageError: an object store or remote filesystem failed while it was read
            (a :class:`gockpt.CheckpointTimeoutError` where it timed out), the original error
            as ``__cause__``.
    """
    fs, root = storage.url_to_fs(path, storage_options, timeout_s)
    try:
        return _read(path, fs, root, verify, allow_pickle, timeout_s)
    except (CheckpointError, FileNotFoundError, NotADirectoryError, ValueError):
        raise
    except Exception as e:  # a store's own error (a botocore read timeout): named as ours
        if storage.is_local(fs):
            raise
        raise fsutil.storage_error(e, path, None, action="reading checkpoint") from e


def framework_files(manifest: Mapping[str, Any]) -> list[str]:
    """The files of a checkpoint written by a :class:`gockpt.writer.CheckpointWriter` that hold
    no tensor of its index and are not its extra file: the framework's own files (Accelerate's
    ``optimizer.bin``, ``random_states_0.pkl``), which :func:`read_checkpoint` cannot read.
    Empty for the engine's own layout. ``manifest``: validated (:func:`gockpt.manifest.validate_manifest`)."""
    if not manifest["meta"].get("writer"):
        return []
    shards = {e["file"] for e in manifest["tensors"].values()}
    return sorted(n for n in manifest["files"]
                  if n != manifest["extra_file"] and n not in shards and not n.endswith(".safetensors"))


def _read(path: str, fs: AbstractFileSystem, root: str, verify: bool, allow_pickle: bool,
          timeout_s: float | None) -> LoadedCheckpoint:
    try:
        manifest = storage.read_manifest(fs, root, timeout_s=timeout_s)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(
            f"{path} is not a complete GoCkpt checkpoint (no manifest.json)"
        ) from None
    if "sharded" in manifest["meta"]:
        raise ValueError(f"{path} is a sharded checkpoint (one part per saving rank): load it with "
                         "gockpt.dcp.load_sharded or gockpt.dcp.load_full")
    own = framework_files(manifest)
    if own:
        raise ValueError(f"{path} is in a framework's own folder layout (written by "
                         f"{manifest['meta']['writer']}; {', '.join(own[:3])} are the framework's "
                         "files): load it with that framework's loader (Accelerate: "
                         "Accelerator.load_state), or `gockpt convert` it")

    by_file = manifest_by_file(manifest)
    local = storage.is_local(fs)
    tensors: dict[str, torch.Tensor] = {}
    for name, file_entry in manifest["files"].items():
        if name == manifest["extra_file"]:
            continue
        file_path = fsutil.join(root, name)
        index = by_file.get(name, {})
        if local:
            tensors.update(_load_local_shard(file_path, file_entry, index, verify))
        else:
            tensors.update(_load_remote_shard(fs, file_path, file_entry, index, verify, timeout_s))
    for alias, target in manifest["aliases"].items():
        tensors[alias] = tensors[target]

    extra_path = fsutil.join(root, manifest["extra_file"])
    blob = read_listed(fs, extra_path, manifest["files"][manifest["extra_file"]], verify, timeout_s=timeout_s)
    try:
        extra = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=not allow_pickle)
    except Exception as e:
        hint = "" if allow_pickle else " (pass allow_pickle=True only if you trust this file)"
        raise CheckpointCorruptError(
            f"{extra_path}: cannot load the non-tensor state{hint}: {type(e).__name__}: {e}"
        ) from e
    return LoadedCheckpoint(tensors=tensors, extra=extra, manifest=manifest)


def _missing(file_path: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{file_path}: file listed in the manifest is missing")


def _check_digest(file_path: str, data: Any, entry: dict, verify: bool) -> None:
    if verify:
        _check_hexdigest(file_path, xxhash.xxh3_64_hexdigest(data), entry)


def _check_hexdigest(file_path: str, digest: str, entry: dict) -> None:
    if digest != entry["xxh3_64"]:
        raise CheckpointCorruptError(
            f"{file_path}: xxh3-64 checksum {digest} does not match the manifest ({entry['xxh3_64']})"
        )


def read_listed(fs: AbstractFileSystem, file_path: str, entry: dict, verify: bool, *,
                max_bytes: int | None = None,
                timeout_s: float | None = storage.DEFAULT_STORAGE_TIMEOUT_S) -> bytes:
    """The bytes of ``file_path``, which a manifest lists as ``entry`` (``bytes``, ``xxh3_64``):
    read as untrusted (a regular file, no symlink, FIFO or device; exactly the recorded size,
    at most ``max_bytes``), the checksum checked with ``verify``.

    Raises:
        CheckpointCorruptError: the file missing, not a regular file, over ``max_bytes``, or not
            the recorded size or checksum (names the file).
    """
    if max_bytes is not None and entry["bytes"] > max_bytes:
        raise CheckpointCorruptError(f"{file_path}: {entry['bytes']} bytes listed, over the "
                                     f"{max_bytes} a file of this kind may hold", path=file_path)
    try:
        data = storage.read_bounded(
            fs, file_path, max_bytes=entry["bytes"], exact_bytes=entry["bytes"], timeout_s=timeout_s
        )
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(file_path) from None
    _check_digest(file_path, data, entry, verify)
    return data


def _decode(file_path: str, data: memoryview | bytes, index: dict[str, dict]) -> int:
    """Decode the header of a whole shard's bytes and check it against the manifest's index
    (:func:`check_shard_header`). Returns the offset of the data section in bytes."""
    # Bounded by the file itself (already size-checked against the manifest).
    return check_shard_header(file_path, read_shard_header(data, len(data)), len(data), index)


def read_shard_header(src: int | BinaryIO | bytes | memoryview, size: int) -> bytes:
    """The first bytes of a shard of ``size`` bytes: its 8-byte length and its header, at most
    :data:`gockpt.format.MAX_HEADER_BYTES` of it and never past ``size`` (two reads from the
    start).

    Args:
        src: a local file descriptor (read with ``pread``), a seekable binary file (an fsspec
            file: it is left positioned after the bytes read), or the shard's bytes.
        size: the shard's size in bytes.
    """
    def read(n: int) -> bytes:
        if isinstance(src, int):
            return os.pread(src, n, 0)
        if isinstance(src, (bytes, memoryview)):
            return bytes(src[:n])
        src.seek(0)
        return src.read(n)

    prefix = read(8)
    if len(prefix) == 8:
        length = int.from_bytes(prefix, "little")
        prefix = read(8 + min(length, MAX_HEADER_BYTES, size))
    return prefix


def check_shard_header(file_path: str, prefix: bytes, size: int, index: dict[str, dict]) -> int:
    """Decode a shard's safetensors header and check it equals the manifest's index of that file.

    Args:
        file_path: the shard, for messages.
        prefix: the file's first bytes: its 8-byte header length and the header.
        size: the file's size in bytes.
        index: the manifest's tensors of this file, by their key in the header
            (:func:`gockpt.manifest.by_file`).

    Returns:
        Offset of the data section in bytes.

    Raises:
        CheckpointCorruptError: a header that does not decode, overruns the file or is over
            :data:`gockpt.format.MAX_HEADER_BYTES`, or lists other tensors, dtypes, shapes or
            offsets than the index (names the file and the key).
    """
    header, data_start = decode_header(prefix, size, file_path)
    unknown = sorted(header.keys() - index.keys())
    if unknown:
        raise CheckpointCorruptError(
            f"{file_path}: tensor {unknown[0]!r} is in the header, not in the manifest"
        )
    for key, want in index.items():
        got = header.get(key)
        if got is None:
            raise CheckpointCorruptError(
                f"{file_path}: tensor {key!r} of the manifest is not in the header"
            )
        for field in ("dtype", "shape", "data_offsets"):
            if got[field] != want[field]:
                raise CheckpointCorruptError(
                    f"{file_path}: tensor {key!r}: header {field} {got[field]!r} "
                    f"disagrees with the manifest ({want[field]!r})"
                )
    return data_start


def _load_local_shard(
    file_path: str, entry: dict, index: dict[str, dict], verify: bool
) -> dict[str, torch.Tensor]:
    try:
        fd, size = storage.open_local_regular(file_path, expected_bytes=entry["bytes"])
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(file_path) from None
    try:
        if size:
            # A private (copy-on-write) map of the descriptor that was checked: the tensors
            # below keep the map alive, writing to them never reaches the file.
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            buf = torch.frombuffer(mapped, dtype=torch.uint8)
        else:
            buf = torch.empty(0, dtype=torch.uint8)
    finally:
        os.close(fd)
    view = buf.numpy().data
    _check_digest(file_path, view, entry, verify)
    data_start = _decode(file_path, view, index)
    out = {}
    for key, want in index.items():
        begin, end = want["data_offsets"]
        raw = buf[data_start + begin : data_start + end]
        dtype = CODE_TO_DTYPE[want["dtype"]]
        if end - begin < OWN_STORAGE_BYTES:
            # Small tensors (RNG states, counters) get their own storage: some torch entry
            # points ignore a view's storage offset (torch.set_rng_state reads from the start
            # of the storage: a wrong state, or a crash on a mapping).
            raw = raw.clone()
        try:
            typed = raw.view(dtype)
        except RuntimeError:  # not aligned to the element size: give it its own storage
            typed = raw.clone().view(dtype)
        out[key] = typed.reshape(want["shape"])
    return out


def _load_remote_shard(
    fs: AbstractFileSystem, file_path: str, entry: dict, index: dict[str, dict], verify: bool,
    timeout_s: float | None,
) -> dict[str, torch.Tensor]:
    """A remote shard's tensors, each in storage of its own, filled piece by piece as the file
    is read (calls of :data:`gockpt._safe_read.READ_PIECE_BYTES`, each bounded by ``timeout_s``
    on a store that may hang): the shard is held once plus a piece, never also as one whole
    ``bytes``. Checked as a whole file is (:func:`read_listed`: its recorded size, its checksum
    with ``verify``, in that order), then its header against ``index``."""
    size = entry["bytes"]
    # A byte past the recorded size tells a longer file.
    source = _safe_read.read_pieces(fs, file_path, size + 1, fsutil.call_bound(fs, timeout_s))

    def read() -> bytes | None:
        try:
            return next(source, None)
        except (FileNotFoundError, NotADirectoryError):
            raise _missing(file_path) from None

    # The pieces holding the header (its 8-byte length first) are kept until it is decoded.
    pieces: list[bytes] = []
    pos = 0
    piece = read()
    while piece is not None:
        pieces.append(piece)
        pos += len(piece)
        head = pieces[0][:8]
        want = 8 + min(int.from_bytes(head, "little"), MAX_HEADER_BYTES, size) if len(head) == 8 else 0
        if pos >= want:
            break
        piece = read()
    joined = b"".join(pieces) if len(pieces) != 1 else pieces[0]
    spans: list[tuple[int, int, str]] = []
    header_error = None
    try:
        data_start = check_shard_header(file_path, read_shard_header(joined, size), size, index)
        spans = sorted((data_start + w["data_offsets"][0], data_start + w["data_offsets"][1], k)
                       for k, w in index.items())
    except CheckpointCorruptError as e:  # told after the size and checksum, as a whole file's
        header_error = e
    del joined
    bufs = {k: torch.empty(b - a, dtype=torch.uint8) for a, b, k in spans}
    views = {k: t.numpy() for k, t in bufs.items()}
    hasher = xxhash.xxh3_64() if verify else None
    at = 0  # file offset of the next piece taken in

    def take(piece: bytes) -> None:
        nonlocal at
        if hasher is not None:
            hasher.update(piece)
        lo, hi = at, at + len(piece)
        for a, b, k in spans:
            if b <= lo or a >= hi:
                continue
            s, e = max(a, lo), min(b, hi)
            views[k][s - a:e - a] = memoryview(piece)[s - lo:e - lo]
        at = hi

    for piece in pieces:
        take(piece)
    pieces = []
    piece = read()
    while piece is not None:
        take(piece)
        piece = read()
    _safe_read.check_read_size(file_path, at, size, size)
    if hasher is not None:
        _check_hexdigest(file_path, hasher.hexdigest(), entry)
    if header_error is not None:
        raise header_error
    out = {}
    for a, b, key in spans:
        want_entry = index[key]
        raw = bufs[key]
        try:
            typed = raw.view(CODE_TO_DTYPE[want_entry["dtype"]])
        except RuntimeError:  # an element size the bytes do not divide: the header check refuses it
            raise CheckpointCorruptError(f"{file_path}: tensor {key!r}: {b - a} bytes do not make "
                                         f"{want_entry['dtype']} elements", path=file_path) from None
        out[key] = typed.reshape(want_entry["shape"])
    return out
