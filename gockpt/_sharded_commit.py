"""Phase two of a sharded save on rank 0: wait for every rank's part, then publish it whole.

See :mod:`gockpt.sharded` for the layout and the protocol (PCcheck §4.1 across ranks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from time import monotonic
from typing import Any

import xxhash

from . import fsutil, storage
from .config import GoCkptConfig
from .handle import CheckpointMetrics, SaveHandle
from .targets import LocalTarget

log = logging.getLogger("gockpt")

SHARDING_FILE = "sharding.json"
INDEX_FILE = "sharded.json"


def part_name(rank: int) -> str:
    """The directory of rank ``rank``'s part in a sharded checkpoint."""
    return f"rank-{rank:05d}"


def sharding_name(rank: int) -> str:
    """The file describing where rank ``rank``'s stored tensors lie in the global tensors."""
    return f"{part_name(rank)}.{SHARDING_FILE}"


def write_atomic(path: str, data: bytes, *, fsync: bool = True) -> None:
    """``data`` at ``path`` through a temporary name and a rename: no reader sees it half
    written (``fsync``: and it is on the disk before it has its name)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.rename(tmp, path)



def xxh3(data: bytes) -> str:
    """xxh3-64 of ``data``, hex (as GoCkpt manifests store file checksums)."""
    return xxhash.xxh3_64(data).hexdigest()


def replicas_differ(views: list[Any]) -> str | None:
    """Why the ranks' replicas may differ, from every rank's view ``[unsynced, ignored, digest]``:
    the parameters requiring gradients that did not when its engine was built (DDP, wrapped
    before, does not average their gradients), the parameters DDP leaves out altogether
    (``_ddp_params_and_buffers_to_ignore``), and a digest of its optimizers' hyperparameters.
    None when they may not (or no view was taken)."""
    if not views or any(v is None for v in views):
        return None

    def listed(names: list[str]) -> str:
        return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"

    ignored = sorted({n for v in views for n in v[1]})
    if ignored:
        return (f"{listed(ignored)} is left out of DDP (_ddp_params_and_buffers_to_ignore): never "
                "broadcast nor averaged, so each rank holds its own copy")
    unsynced = sorted({n for v in views for n in v[0]})
    if unsynced:
        return (f"{listed(unsynced)} requires gradients now but did not when the engine was built: "
                "DDP does not average its gradients, so each rank trains its own copy")
    if len({v[2] for v in views}) > 1:
        return "the optimizers' hyperparameters (learning rates ...) differ between the ranks"
    return None


class PartOvertakenError(RuntimeError):
    """A rank's part ended unwritten with a warning (:attr:`gockpt.SaveHandle.overtaken`): the
    checkpoint is not committed, and that is a warning of the run, not an error."""


def commit(path: str, stage: str, target: int, own: SaveHandle, *, world: int,
           config: GoCkptConfig, timeout_s: float, replicated: bool = False, run: int = 0,
           framework_names: re.Pattern[str] | None = None,
           abandoned: Callable[[], bool] = lambda: False) -> CheckpointMetrics:
    """Wait for every part in ``stage``, check them, write the index and the global manifest
    last, publish ``stage`` as ``path`` and move ``latest`` (rank 0's commit thread).

    Args:
        path: the checkpoint directory.
        stage: its staging directory, holding ``rank-<r>/`` parts and their markers.
        target: the planned captured step (a collective ``wait()`` may have captured earlier:
            then every part must hold rank 0's own captured step).
        own: rank 0's part handle.
        world: number of parts.
        config: engine options (``update_latest``, storage options and timeout).
        timeout_s: seconds to wait for the other parts once rank 0's own is durable.
        replicated: the parts are shares of a replicated state (DDP ranks sharing the write:
            each tensor whole, in one part); recorded in the index and in ``meta.sharded``.
        run: the run it records (``meta["run"]``, ordering it for ``latest``:
            :meth:`gockpt.Engine.run_for` of rank 0's engine in the checkpoint's directory).
        framework_names: entries of a checkpoint the writer's framework wrote itself, which
            the publish may replace (:attr:`gockpt.writer.CheckpointWriter.framework_names`).
        abandoned: True once this rank's run has failed and is closing: a part still missing
            is waited for only while its rank's files keep growing (:func:`await_part`).

    Returns:
        Rank 0's part metrics.

    Raises:
        PartOvertakenError: another rank's part ended unwritten with a warning.
        RuntimeError: a part failed or holds another step; TimeoutError: a part did not arrive
            within ``timeout_s`` (a crashed or stalled rank). Rank 0's own part's error when it
            failed. The staging directory is removed (once the other parts have ended, so that
            none fails for a directory gone under it) and the previous checkpoint stays the
            latest.
    """
    published = False
    try:
        try:
            metrics = own.result()
        except BaseException:
            # The other ranks are still writing their parts into the stage.
            settle_parts(stage, range(1, world), monotonic() + timeout_s, abandoned)
            raise
        target = metrics.captured_step if metrics.captured_step is not None else target
        deadline = monotonic() + timeout_s
        for r in range(world):
            try:
                await_part(stage, r, deadline, abandoned)
            except BaseException:
                settle_parts(stage, range(r + 1, world), deadline, abandoned)
                raise
        fs, root = fsutil.url_to_fs(path, None)
        parts, files = [], {}
        views = []
        for r in range(world):
            part = os.path.join(stage, part_name(r))
            manifest = storage.read_manifest(fs, part)
            step = manifest["meta"].get("captured_step")
            if step != target or not storage.is_complete(part):
                raise RuntimeError(f"gockpt: part {part_name(r)} holds step {step}, not {target}")
            with open(os.path.join(part, storage.MANIFEST_NAME), "rb") as f:
                raw = f.read()
            parts.append({"name": part_name(r), "manifest_bytes": len(raw), "manifest_xxh3_64": xxh3(raw)})
            os.unlink(os.path.join(stage, f"{part_name(r)}.done"))
            # Written at the capture, before .done; read by this thread alone: a checkpoint keeps
            # no marker.
            views.append(_replica_view(os.path.join(stage, f"{part_name(r)}.captured")))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(stage, f"{part_name(r)}.captured"))
            with open(os.path.join(stage, sharding_name(r)), "rb") as f:
                raw = f.read()
            files[sharding_name(r)] = {"bytes": len(raw), "xxh3_64": xxh3(raw)}
        if replicated:
            differ = replicas_differ(views)
            if differ is not None:
                # Shares of copies that drifted apart inside the copy windows: no one state.
                why = f"gockpt: sharded checkpoint {path}: the replicas differ at its captured step ({differ})"
                log.warning("%s", why)
                raise PartOvertakenError(why)
        index = json.dumps({"format": "gockpt-sharded", "world_size": world, "replicated": replicated,
                            "captured_step": target, "parts": parts}, sort_keys=True).encode()
        target_dir = LocalTarget(fs, root, staging=stage, framework_names=framework_names)
        try:
            nbytes, digest = target_dir.write(INDEX_FILE, iter([index]), lambda: None)
            meta = {"requested_step": metrics.requested_step, "captured_step": target,
                    "created_unix_s": time.time(), "run": run,
                    "mode": metrics.mode, "num_overlap_steps": metrics.num_overlap_steps,
                    "sharded": {"world_size": world, "replicated": replicated,
                                "parts": [p["name"] for p in parts]}}
            manifest = {"format": "gockpt", "format_version": 1,
                        "files": {**files, INDEX_FILE: {"bytes": nbytes, "xxh3_64": digest}},
                        "tensors": {}, "aliases": {}, "extra_file": INDEX_FILE, "meta": meta}
            blob = json.dumps(manifest, sort_keys=True).encode()
            target_dir.prepare(blob)
            target_dir.publish(blob)
            published = True
        finally:
            target_dir.cleanup(published)
        if config.update_latest:
            storage.advance_latest(path, target, config.storage_options, config.storage_timeout_s,
                                   run=run)
        return metrics
    finally:
        if not published:
            fsutil.remove_local(stage)
            log.warning("gockpt: sharded checkpoint %s not committed", path)


def _replica_view(marker: str) -> Any:
    """The replica view a ``rank-<r>.captured`` marker records (None: none, or unreadable)."""
    try:
        with open(marker, "rb") as f:
            raw = f.read(1 << 20)
        return json.loads(raw) if raw else None
    except (OSError, ValueError):
        return None


def settle_parts(stage: str, ranks: Any, deadline: float, abandoned: Callable[[], bool]) -> None:
    """Wait, as :func:`await_part` does, for the parts of ``ranks`` to end, however they end: a
    commit that fails removes the stage only once no rank writes into it any more."""
    for r in ranks:
        with contextlib.suppress(Exception):
            await_part(stage, r, deadline, abandoned)


def mark(stage: str, rank: int, handle: SaveHandle | Future[Any]) -> None:
    """Phase one's outcome for rank 0: ``rank-<r>.done``, ``rank-<r>.failed``, or
    ``rank-<r>.overtaken`` for a part that ended unwritten with a warning (atomic).

    ``handle``: the finished save of this rank's part (a handle or a future: its ``result(0)``).
    """
    try:
        handle.result(0)
        kind = "done"
    except BaseException:  # noqa: BLE001 - the outcome is what the marker tells
        kind = "overtaken" if getattr(handle, "overtaken", False) else "failed"
    if os.path.isdir(stage):
        _write_marker(stage, rank, kind, durable=True)


def _write_marker(stage: str, rank: int, kind: str, *, durable: bool, data: bytes = b"") -> None:
    """``rank-<r>.<kind>`` in ``stage`` holding ``data`` (``durable``: written atomically and
    fsynced; else a signal to the living commit thread only, written in place of the file's
    name so that no reader sees it half written). Best effort."""
    path = os.path.join(stage, f"{part_name(rank)}.{kind}")
    try:
        if durable or data:
            write_atomic(path, data, fsync=durable)
        else:
            open(path, "wb").close()  # noqa: SIM115 - an empty file
    except OSError as e:  # the staging directory was removed by an abort
        log.info("gockpt: could not mark part %d of %s %s: %s", rank, stage, kind, e)


#: Seconds a failed run's commit waits for a missing part that its rank has not captured yet
#: (no ``rank-<r>.captured`` marker) and that shows no progress (no file of it growing): that
#: rank is not going to write it (stuck in a collective the failed rank left, or dead), and
#: stock's failed run exits at once. A captured part needs no other rank to finish (replay
#: and persist): it is waited for up to ``commit_timeout_s``.
ABANDON_IDLE_S = 10.0


def await_part(stage: str, rank: int, deadline: float,
               abandoned: Callable[[], bool] = lambda: False) -> None:
    """Wait for rank ``rank``'s marker until ``deadline`` (``monotonic()``), or, once
    ``abandoned()`` (this rank's run failed), until its part has shown no progress for
    :data:`ABANDON_IDLE_S` seconds.

    Raises:
        PartOvertakenError: the part ended unwritten with a warning.
        RuntimeError: the part failed, or was abandoned; TimeoutError: no marker by ``deadline``.
    """
    done = os.path.join(stage, f"{part_name(rank)}.done")
    failed = os.path.join(stage, f"{part_name(rank)}.failed")
    overtaken = os.path.join(stage, f"{part_name(rank)}.overtaken")
    captured = os.path.join(stage, f"{part_name(rank)}.captured")
    delay = 0.002
    progress, since = None, monotonic()
    while not os.path.exists(done):
        if os.path.exists(failed):
            raise RuntimeError(f"gockpt: rank {rank}'s part of the sharded checkpoint failed")
        if os.path.exists(overtaken):
            raise PartOvertakenError(f"gockpt: rank {rank}'s part of the sharded checkpoint was not "
                                     "written (see that rank's warning)")
        now = monotonic()
        if now > deadline:
            raise TimeoutError(f"gockpt: rank {rank}'s part of the sharded checkpoint did not "
                               f"arrive within commit_timeout_s (crashed or stalled rank)")
        if abandoned() and not os.path.exists(captured):
            seen = _part_progress(stage, part_name(rank))
            if seen != progress:
                progress, since = seen, now
            elif now - since > ABANDON_IDLE_S:
                raise RuntimeError(
                    f"gockpt: the run failed and rank {rank}'s part of the sharded checkpoint, "
                    f"not captured, made no progress for {ABANDON_IDLE_S:.0f} s: not committed")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _part_progress(stage: str, part: str) -> tuple[tuple[str, int], ...]:
    """The names and sizes of the files of part ``part`` in ``stage``: its directory, the
    staging directory it is written in before that (``.<part>.gockpt-tmp-...``), its markers."""
    out = []
    for dirpath, dirs, names in os.walk(stage):
        if dirpath == stage:  # below the stage: only what belongs to this part
            dirs[:] = [d for d in dirs if part in d]
            names = [n for n in names if part in n]
        for name in names:
            try:
                out.append((os.path.join(dirpath, name), os.lstat(os.path.join(dirpath, name)).st_size))
            except FileNotFoundError:
                continue
    return tuple(sorted(out))


def mark_captured(stage: str, rank: int, view: Any = None) -> None:
    """``rank-<r>.captured``: rank ``r``'s part has taken its state; what is left (replay,
    persist) needs no other rank (see :data:`ABANDON_IDLE_S`). Written on the training thread
    at a step boundary, not fsynced (only the living commit thread reads it). It holds the
    rank's replica view at the captured step (JSON; ``view``, replicated states), which the
    commit compares (:func:`replicas_differ`); else empty. Best effort."""
    _write_marker(stage, rank, "captured", durable=False,
                  data=b"" if view is None else json.dumps(view).encode())
