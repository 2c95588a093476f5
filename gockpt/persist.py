"""Persist one snapshot slot as a checkpoint directory: shards in parallel, manifest last.

Call sequence of one save (the engine runs :func:`persist` on one of its worker threads):

1. (persist thread) check the request, open a target: a staging directory next to the
   checkpoint on a local filesystem (holding a writer lock that
   :func:`gockpt.storage.cleanup_staging` respects), the checkpoint directory itself on an
   object store.
2. (io threads, ``num_io_threads``; the engine passes at most :func:`io_threads_cap`) stream
   each shard as header bytes + ``chunk_bytes`` slices of the slot (memoryviews: no
   serialization copy) and the extra blob, hashing the same chunks with xxh3-64 (GoCkpt
   §4.4.1, §4.4.3: multi-threaded persistence). Every file is opened through the fsspec
   filesystem of ``path``, the seam where tests inject faults. Writes, checksums and fsync
   release the GIL; the io threads run at ``io_nice`` (:func:`lower_thread_priority`).
3. (persist thread) write ``manifest.json`` last; locally fsync files, manifest and staging dir.
4. (persist thread, under ``publish_lock``) unless cancelled or superseded: publish. Locally an
   atomic rename, or an atomic exchange with a previous checkpoint at the same path; on an
   object store one put of the manifest (GoCkpt §4.4.3: the metadata marks completion). Then
   ``on_published()``.
5. (persist thread) delete what the new checkpoint replaced, move ``latest`` forward
   (PCcheck §4.1). A failure here does not fail the save: the checkpoint is durable.

On cancel or error every file of this save is removed (object stores: partial objects deleted,
multipart uploads aborted) and the previously published checkpoint is left untouched; the
error raised is the original one, with the checkpoint's path, never a clean-up failure (those
are logged at WARNING).
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import json
import logging
import os
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch

from gockpt import _trace, storage
from gockpt._pointer import run_of
from gockpt.errors import (
    CheckpointCancelledError,
    CheckpointError,
)
from gockpt.format import ShardLayout
from gockpt.manifest import build_manifest, check_name
from gockpt.targets import FileOrigin, LocalTarget, StorageTarget, open_target

__all__ = [
    "CheckpointCancelledError", "PersistRequest", "PersistResult", "lower_thread_priority", "persist",
]

log = logging.getLogger(__name__)


@dataclass
class PersistRequest:
    """One checkpoint to write.

    Attributes:
        path: checkpoint directory, a local path or fsspec URL (``memory://``, ``s3://``).
        shards: layouts from :func:`gockpt.format.plan_shards` with a prefix unique to this save.
        slot: ``(n,)`` uint8 CPU tensor (pinned on CUDA) holding the shards' data sections.
        shard_bases: byte offset in ``slot`` where shard ``i``'s data section starts.
        extra: ``torch.save`` bytes of the non-tensor state.
        aliases: alias key -> stored key (tied weights).
        meta: JSON-able engine metadata; ``meta["captured_step"]`` (int) is required when
            ``update_latest``.
        storage_options: fsspec options.
        num_io_threads: threads writing files in parallel, >= 1.
        chunk_bytes: write and checksum granularity in bytes, >= 1.
        update_latest: move the ``latest`` pointer in the parent directory after publishing.
        cancel: set => abort as soon as possible and raise :class:`CheckpointCancelledError`.
        publish_lock: held around the publish step.
        is_superseded: called under ``publish_lock`` right before publishing; True => discard
            this save (``PersistResult.published`` is False), not an error.
        on_published: called under ``publish_lock`` right after a successful publish.
        storage_timeout_s: bound in seconds on one object-store operation (request with its
            retries, see :func:`gockpt.storage.url_to_fs`) and on one chunk write to a
            non-local filesystem; None: the filesystem's own defaults and no chunk deadline.
        target_factory: ``(fs, root, names, timeout_s) -> StorageTarget``: where the files go
            and how the save is published (default :func:`gockpt.targets.open_target`).
        shard_segments: per shard, the ``[begin, end)`` byte ranges of ``slot`` that make its
            data section, in file order (a gather write: the tensors of one file need not be
            adjacent in the slot); None: ``[(shard_bases[i], shard_bases[i] + data_bytes)]``.
        files: more whole files to write (name -> bytes), listed in the manifest.
        before_publish: called with the target after every file is written, before the
            manifest (e.g. wait for files other processes add to a local staging directory);
            it may raise to fail the save.
        io_nice: niceness the io threads add to the process's (:func:`lower_thread_priority`);
            None: none.
        direct_io: local targets write shard files with ``O_DIRECT`` where the filesystem
            allows it (:mod:`gockpt._direct`).
        on_slot_read: called once, on an io thread, when every piece of the shard files and of
            ``files`` has been written and checksummed (before their ``fsync``, the manifest
            and the publish): ``slot`` may be reused from then on. A write call does not keep
            its buffer after it returns (Python's ``io`` contract), so nothing reads the slot
            after this. Not called when a write fails first; it must not raise.
        on_chunk_read: called with ``(begin, end)`` on an io thread each time one of the
            :func:`slot_chunks` ranges has been written and checksummed; it must not raise.
        reuse: shard file name -> the file of an earlier checkpoint that holds the very bytes
            this shard would be written with (the caller's guarantee): it is hard-linked where
            the target can (:meth:`gockpt.targets.StorageTarget.link`), else written. Its
            slot ranges count as read once linked: ``on_chunk_linked`` is called for them
            where set (else ``on_chunk_read``), since no write took its time.
        origins_of: the shard file names whose published place :attr:`PersistResult.origins`
            reports (those a later save may link: ``frozen_copy="when_changed"``); the others
            are not ``lstat``-ed after the publish.
    """

    path: str
    shards: list[ShardLayout]
    slot: torch.Tensor
    shard_bases: list[int]
    extra: bytes
    aliases: dict[str, str]
    meta: dict
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    num_io_threads: int = 4
    chunk_bytes: int = 4 << 20
    update_latest: bool = True
    cancel: threading.Event = field(default_factory=threading.Event)
    publish_lock: threading.Lock = field(default_factory=threading.Lock)
    is_superseded: Callable[[], bool] = lambda: False
    on_published: Callable[[], None] = lambda: None
    storage_timeout_s: float | None = storage.DEFAULT_STORAGE_TIMEOUT_S
    target_factory: Callable[..., StorageTarget] = open_target
    shard_segments: list[list[tuple[int, int]]] | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    before_publish: Callable[[StorageTarget], None] = lambda target: None
    io_nice: int | None = None
    direct_io: bool = True
    on_slot_read: Callable[[], None] | None = None
    on_chunk_read: Callable[[int, int], None] | None = None
    reuse: Mapping[str, FileOrigin] = field(default_factory=dict)
    on_chunk_linked: Callable[[int, int], None] | None = None
    origins_of: Collection[str] = ()


@dataclass
class PersistResult:
    """Outcome of :func:`persist`.

    Attributes:
        published: False when the save was superseded and discarded.
        bytes_written: bytes of all files written, the manifest included once published.
        seconds: wall time of :func:`persist`.
        files: name -> {"bytes": int, "xxh3_64": 16 hex digits}, as in the manifest.
        bytes_linked: bytes of the shard files linked from an earlier checkpoint (``reuse``),
            not written (nor counted in ``bytes_written``).
        origins: shard file name -> where it lies once published, for a later save's
            ``reuse``, for the names in ``origins_of``; empty where the target links nothing,
            or nothing was published.
        latest_error: None, or why ``latest`` could not be moved to this published checkpoint
            (e.g. ``ENOSPC``); the checkpoint is durable and
            :func:`gockpt.storage.latest_checkpoint` still finds it (see
            :func:`gockpt.storage.advance_latest`).
    """

    published: bool
    bytes_written: int
    seconds: float
    files: dict[str, dict]
    latest_error: str | None = None
    bytes_linked: int = 0
    origins: dict[str, FileOrigin] = field(default_factory=dict)


class _Aborted(Exception):
    """Another file of the same save failed; this one stops early."""


def persist(req: PersistRequest) -> PersistResult:
    """Write ``req`` as a complete checkpoint at ``req.path`` (see the module doc for the steps).

    Args:
        req: the request; ``req.slot`` must stay unchanged until this returns, or until
            ``req.on_slot_read`` is called.

    Returns:
        A :class:`PersistResult`. A checkpoint that was published is reported as published even
        when moving ``latest`` failed afterwards (a :class:`RuntimeWarning` names the pointer
        file and the errno; ``PersistResult.latest_error`` says why).

    Raises:
        CheckpointCancelledError: ``req.cancel`` was set before publishing.
        CheckpointTimeoutError: a storage operation passed ``req.storage_timeout_s``.
        CheckpointStorageError: the filesystem or object store failed (e.g. ``ENOSPC``, HTTP
            500); also an ``OSError`` with the original ``errno``; the message names ``req.path``
            and the file; ``__cause__`` is the original error.
        ValueError, TypeError: a malformed request (slot too small, bad names, meta not JSON).
        Any error raised by ``is_superseded`` or ``on_published``, unchanged. In every error
        case the files of this save are removed and the previous checkpoint is intact.
    """
    start = perf_counter()
    captured_step = _check_request(req)
    extra_name = f"state-{uuid.uuid4().hex[:12]}.pt"
    target: StorageTarget
    try:
        fs, root = storage.url_to_fs(req.path, req.storage_options, req.storage_timeout_s)
        names = [s.file for s in req.shards] + [extra_name]
        target = req.target_factory(fs, root, names, req.storage_timeout_s)
        if isinstance(target, LocalTarget):
            target.direct_io = req.direct_io
    except (CheckpointError, ValueError, TypeError):
        raise
    except Exception as e:
        raise storage.storage_error(e, req.path, None) from e
    published = False
    linked: set[str] = set()
    try:
        files = _write_files(req, target, extra_name, linked)
        manifest = build_manifest(req.shards, files, req.aliases, extra_name, req.meta)
        # Compact, so json's C encoder writes it (with ``indent`` the pure-Python encoder ran on
        # the persist thread, holding the GIL for ~3 ms per 100 tensors); ``python -m json.tool``
        # prints it readably.
        manifest_bytes = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
        _check_cancel(req)
        try:  # the writer's own check: its errors as they are, a storage one's as one
            req.before_publish(target)
        except CheckpointError:
            raise
        except OSError as e:
            raise storage.storage_error(e, req.path, None) from e
        _check_cancel(req)
        with _trace.phase("manifest", len(manifest_bytes)):
            _guard(req, target.manifest_path, target.prepare, manifest_bytes)
        with req.publish_lock:
            _check_cancel(req)
            if not req.is_superseded():
                with _trace.phase("publish"):
                    _guard(req, target.manifest_path, target.publish, manifest_bytes)
                published = True
                req.on_published()
    finally:
        target.cleanup(published)
    origins: dict[str, FileOrigin] = {}
    if published:
        for shard in req.shards:
            if shard.file not in req.origins_of:
                continue
            path = target.local_path(shard.file)
            if path is not None:
                try:
                    origins[shard.file] = FileOrigin.of(path, files[shard.file]["xxh3_64"])
                except OSError:  # moved away already: nothing to link from
                    pass
    latest_error = None
    if published and captured_step is not None:  # captured_step is set iff update_latest
        try:
            with _trace.phase("latest"):
                storage.advance_latest(
                    req.path, captured_step, req.storage_options, req.storage_timeout_s,
                    run=run_of(req.meta),
                )
        except Exception as e:  # noqa: BLE001 - the checkpoint is durable: warn, do not fail
            latest_error = str(e)
            code = getattr(e, "errno", None)
            message = (
                f"gockpt: checkpoint {req.path!r} is durable, but moving 'latest' failed "
                f"(errno {code}{f' {errno.errorcode.get(code, code)}' if code else ''}): {e}"
            )
            log.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    written = sum(f["bytes"] for n, f in files.items() if n not in linked)
    return PersistResult(
        published=published,
        bytes_written=written + (len(manifest_bytes) if published else 0),
        seconds=perf_counter() - start,
        files=files,
        latest_error=latest_error,
        bytes_linked=sum(files[n]["bytes"] for n in linked),
        origins=origins,
    )


def io_threads_cap() -> int:
    """The most io threads the engine gives one save: the CPU cores this process may use, less
    the one the training thread needs, at least 1 (writes into the page cache and checksums are
    CPU work: more threads than spare cores only take cores from training)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, cores - 1)


def lower_thread_priority(io_nice: int | None) -> None:
    """Run the calling thread at the process's niceness plus ``io_nice`` (at most 19), on Linux.

    Linux keeps a niceness per thread, and a thread without an explicit I/O priority class gets
    the best-effort level ``(niceness + 20) // 5`` from it (``ioprio_set(2)``; honoured by the
    BFQ scheduler), so this lowers both the CPU and the I/O priority of this thread only. Never
    raises the priority; threads it starts inherit it. A no-op for None or 0, on other systems,
    and where the system refuses (logged at DEBUG).

    Args:
        io_nice: niceness to add, 0..19, or None.
    """
    if not io_nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        wanted = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + io_nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < wanted:
            os.setpriority(os.PRIO_PROCESS, tid, wanted)
    except OSError as e:
        log.debug("gockpt: could not lower the priority of thread %s: %s", tid, e)


def _check_request(req: PersistRequest) -> int | None:
    slot = req.slot
    if not (
        isinstance(slot, torch.Tensor)
        and slot.dtype == torch.uint8
        and slot.dim() == 1
        and slot.device.type == "cpu"
        and slot.is_contiguous()
    ):
        raise TypeError("slot must be a contiguous 1-D torch.uint8 CPU tensor")
    if req.shard_segments is None and len(req.shards) != len(req.shard_bases):
        raise ValueError(f"{len(req.shards)} shards but {len(req.shard_bases)} shard bases")
    names = set()
    if req.shard_segments is not None and len(req.shard_segments) != len(req.shards):
        raise ValueError(f"{len(req.shards)} shards but {len(req.shard_segments)} segment lists")
    for i, shard in enumerate(req.shards):
        check_name(shard.file, req.path)
        if shard.file in names or shard.file == storage.MANIFEST_NAME:
            raise ValueError(
                f"{req.path}: shard file name {shard.file!r} is used twice or reserved"
            )
        names.add(shard.file)
        segments = _segments(req, i)
        if sum(e - b for b, e in segments) != shard.data_bytes:
            raise ValueError(f"shard {shard.file!r}: its segments do not add up to its data")
        for b, e in segments:
            if not 0 <= b <= e <= slot.numel():
                raise ValueError(
                    f"shard {shard.file!r}: bytes [{b}, {e}) lie outside the slot "
                    f"({slot.numel()} bytes)"
                )
    for name in req.files:
        check_name(name, req.path)
        if name in names or name == storage.MANIFEST_NAME:
            raise ValueError(f"{req.path}: file name {name!r} is used twice or reserved")
        names.add(name)
    keys = {k for shard in req.shards for k in shard.offsets}
    for alias, target in req.aliases.items():
        if target not in keys or alias in keys:
            raise ValueError(f"alias {alias!r} -> {target!r}: target must be stored, alias not")
    if req.num_io_threads < 1 or req.chunk_bytes < 1:
        raise ValueError("num_io_threads and chunk_bytes must be >= 1")
    json.dumps(req.meta, allow_nan=False)  # fail before writing anything if meta is not strict JSON
    if not req.update_latest:
        return None
    step = req.meta.get("captured_step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError("meta['captured_step'] must be an int when update_latest is set")
    return step


def _segments(req: PersistRequest, i: int) -> list[tuple[int, int]]:
    if req.shard_segments is not None:
        return req.shard_segments[i]
    base = req.shard_bases[i]
    return [(base, base + req.shards[i].data_bytes)]


def _whole(view: memoryview, chunk_bytes: int) -> Callable[[], Iterator[memoryview | bytes]]:
    return lambda: _chunks(view, 0, len(view), chunk_bytes)


def _check_cancel(req: PersistRequest) -> None:
    if req.cancel.is_set():
        raise CheckpointCancelledError(f"save of {req.path} was cancelled")


def _guard(req: PersistRequest, file_path: str, fn: Callable[[bytes], None], data: bytes) -> None:
    try:
        fn(data)
    except CheckpointError:
        raise
    except Exception as e:
        raise storage.storage_error(e, req.path, file_path) from e


def _count_reads(jobs: list, done: Callable[[], None]) -> list:
    """``jobs`` whose pieces call ``done()`` once the last of them has been consumed: a target
    asks for the next piece only after writing and checksumming the one before (its ``for``
    loop), so then no byte of these jobs is read again."""
    left = [len(jobs)]
    lock = threading.Lock()

    def counted(pieces: Callable[[], Iterator[memoryview | bytes]]) -> Iterator[memoryview | bytes]:
        yield from pieces()
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            try:
                done()
            except Exception:  # noqa: BLE001 - must not fail the write that merely ended
                log.exception("gockpt: on_slot_read failed")

    if not jobs:
        done()
        return jobs
    return [(n, name, functools.partial(counted, pieces)) for n, name, pieces in jobs]


def _ranges(begin: int, end: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    for offset in range(begin, end, chunk_bytes):
        yield offset, min(offset + chunk_bytes, end)


def slot_chunks(req: PersistRequest) -> list[list[tuple[int, int]]]:
    """Per shard file, in the order :func:`persist` starts them (largest first), the
    ``[begin, end)`` byte ranges of ``req.slot`` it reads for it, as the pieces it writes, in
    order (``req.on_chunk_read`` reports each once written)."""
    order = sorted(range(len(req.shards)), key=lambda i: -req.shards[i].file_bytes)  # as _write_files
    return [list(_slot_pieces(req, i)) for i in order]


def _slot_pieces(req: PersistRequest, i: int) -> Iterator[tuple[int, int]]:
    """The ``[begin, end)`` byte ranges of ``req.slot`` that shard ``i``'s data is written in,
    in order: one per piece of at most ``chunk_bytes``."""
    for b, e in _segments(req, i):
        yield from _ranges(b, e, req.chunk_bytes)


def io_threads(req: PersistRequest) -> int:
    """How many files :func:`persist` writes at once for ``req``."""
    return max(1, min(req.num_io_threads, len(req.shards) + len(req.files) + 1))


def _chunks(data: memoryview, begin: int, end: int, chunk_bytes: int) -> Iterator[memoryview]:
    for lo, hi in _ranges(begin, end, chunk_bytes):
        yield data[lo:hi]


def _write_files(req: PersistRequest, target: StorageTarget, extra_name: str,
                 linked: set[str]) -> dict[str, dict]:
    """Write every file of ``req`` (linking those of ``req.reuse`` where the target can, their
    names added to ``linked``); name -> {"bytes", "xxh3_64"}."""
    slot_view = req.slot.numpy().data
    extra_view = memoryview(req.extra)
    jobs: list[tuple[int, str, Callable[[], Iterator[memoryview | bytes]]]] = []
    for i, shard in enumerate(req.shards):

        def pieces(shard: ShardLayout = shard, i: int = i) -> Iterator[memoryview | bytes]:
            yield shard.header
            read = req.on_chunk_read
            if shard.file in linked and req.on_chunk_linked is not None:
                read = req.on_chunk_linked  # freed, but not written: no part of the pace
            for lo, hi in _slot_pieces(req, i):
                yield slot_view[lo:hi]
                if read is not None:  # asked for the next piece: this one is written
                    read(lo, hi)

        jobs.append((shard.file_bytes, shard.file, pieces))
    for name, data in req.files.items():
        jobs.append((len(data), name, _whole(memoryview(data), req.chunk_bytes)))
    if req.on_slot_read is not None:
        jobs = _count_reads(jobs, req.on_slot_read)
    jobs.append(
        (
            len(extra_view),
            extra_name,
            _whole(extra_view, req.chunk_bytes),
        )
    )
    jobs.sort(key=lambda job: -job[0])  # largest first balances the threads

    abort = threading.Event()

    def check() -> None:
        _check_cancel(req)
        if abort.is_set():
            raise _Aborted

    def run(name: str, pieces: Callable[[], Iterator[memoryview | bytes]]) -> tuple[int, str]:
        try:
            check()
            try:
                origin = req.reuse.get(name)
                got = None if origin is None else target.link(name, origin)
                if got is not None:
                    linked.add(name)
                    for _ in pieces():  # its slot ranges count as read (read callbacks)
                        check()
                    return got
                return target.write(name, pieces(), check)
            except (CheckpointError, _Aborted):
                raise
            except Exception as e:
                raise storage.storage_error(e, req.path, target.file_path(name)) from e
        except BaseException:
            abort.set()
            raise

    num_threads = io_threads(req)  # len(jobs) or fewer
    with concurrent.futures.ThreadPoolExecutor(
        num_threads, thread_name_prefix="gockpt-io", initializer=lower_thread_priority,
        initargs=(req.io_nice,),
    ) as pool:
        futures = {name: pool.submit(run, name, pieces) for _, name, pieces in jobs}
        concurrent.futures.wait(futures.values())
    errors = [e for f in futures.values() if (e := f.exception()) is not None]
    if errors:
        if req.cancel.is_set():
            raise CheckpointCancelledError(f"save of {req.path} was cancelled") from errors[0]
        raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])
    files = {}
    for name, future in futures.items():
        nbytes, digest = future.result()
        files[name] = {"bytes": nbytes, "xxh3_64": digest}
    return files
