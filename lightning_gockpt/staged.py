"""Checkpoints a strategy writes in its own format, committed by GoCkpt: staging, markers, one rename.

Some strategies write their checkpoints themselves, in their own format, on every rank
(DeepSpeed's files, ``FSDPStrategy``'s sharded DCP directory). GoCkpt keeps the format (the
strategy loads it as its own) and changes when and how it lands:

1. (every rank, training thread, :meth:`StagedAdapterEngine.save`) global rank 0 makes a
   staging directory beside the checkpoint path (locked, named so that
   :func:`gockpt.storage.cleanup_staging` knows it) and broadcasts it; the strategy's writer
   (``write``) takes what it must at once (a copy into host memory: the stall) and returns a
   future of its files in the staging directory, written and fsynced in the background.
2. (every rank) when that future resolves, the rank's marker ``rank-<r>.done`` (or
   ``.failed``) is written into the staging directory.
3. (commit thread, global rank 0) waits at most ``commit_timeout_s`` for every marker, removes
   them, fsyncs and renames the staging directory into place (an atomic exchange where the
   kernel has it: :class:`gockpt.targets.LocalTarget`). A rank that fails or dies leaves no
   checkpoint at the path, and the previous one there is untouched (PCcheck §4.1).

The engine has the interface :class:`~lightning_gockpt.GoCkptCallback` drives (``save``,
``wait``, ``remove``, ``close`` and the step hooks), and its handles that of a save handle.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from time import monotonic, perf_counter
from typing import Any

import gockpt
from gockpt import CheckpointMetrics, GoCkptConfig
from gockpt._sharded_commit import await_part, mark, part_name
from gockpt.fsutil import fsync_path, is_local, path_key, url_to_fs
from gockpt.storage import BackgroundDeleter, ClaimedStaging, check_save_path
from gockpt.targets import LocalTarget

log = logging.getLogger("lightning_gockpt")

COMMIT_TIMEOUT_S = 300.0  # seconds rank 0 waits for the other ranks' files once its own are written

Writer = Callable[[str, dict], "tuple[Future[int], int]"]
"""``write(stage, checkpoint) -> (future of the bytes written, bytes copied now)``: puts the
strategy's files of Lightning's ``checkpoint`` dict into ``stage`` (collective, every rank)."""


class StagedHandle:
    """One staged checkpoint in flight; the interface the callback uses (as a SaveHandle)."""

    skipped = False

    def __init__(self, path: str, future: Future[CheckpointMetrics]) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[StagedHandle], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def result(self, timeout_s: float | None = None) -> CheckpointMetrics:
        """The save's metrics once durable (committed, on global rank 0).

        Raises:
            TimeoutError: not finished within ``timeout_s`` seconds.
            The save's own error (a failed write, a missing rank: ``TimeoutError``).
        """
        return self._future.result(timeout_s)

    outcome = result  # no engine raises this save's error again: nothing to tell apart


class StagedAdapterEngine:
    """The engine interface :class:`~lightning_gockpt.GoCkptCallback` drives over a strategy's writer.

    Args:
        strategy: the Lightning strategy (``broadcast``, ``barrier``).
        config: engine options (``max_inflight``: saves in flight per rank at once, each holding
            its own host copy; ``storage_options`` must name a local filesystem).
        write: the strategy's :data:`Writer`.
        rank: this process's global rank; ``world``: the number of processes.
        collective: whether the ranks still meet (False once this rank's run failed).
        commit_timeout_s: seconds rank 0 waits for the other ranks' markers once its own files
            are written (a crashed or stalled rank: the save fails, nothing is published).
        max_inflight: saves in flight per rank at once; None: ``config.max_inflight`` (a writer
            whose background work runs collectives needs 1: two saves' collectives on one group
            could interleave differently on different ranks).

    With more than one rank the engine makes a gloo group over them for its own collectives
    (collective: build it on every rank). ``write`` may have a ``close()``, called by
    :meth:`close`, and a ``framework_names`` pattern: the entries of a checkpoint in its format
    (:attr:`gockpt.writer.CheckpointWriter.framework_names`).
    """

    def __init__(self, strategy: Any, config: GoCkptConfig, write: Writer, *, rank: int, world: int,
                 collective: Callable[[], bool],
                 commit_timeout_s: float = COMMIT_TIMEOUT_S, max_inflight: int | None = None) -> None:
        self.strategy = strategy
        self.config = config
        self.rank, self.world = rank, world
        self.commit_timeout_s = commit_timeout_s
        self.max_inflight = max(1, config.max_inflight if max_inflight is None else max_inflight)
        self._group = None
        if world > 1:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=commit_timeout_s))
        self._write = write
        # A directory in the strategy's own format is replaced by a save of its path; any
        # other non-empty one is refused (gockpt.fsutil.check_replaceable).
        self._framework_names = getattr(write, "framework_names", None)
        self._collective = collective
        self.version = 0  # batch ends seen: the step the metrics name
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="gockpt-commit") if rank == 0 else None
        self._handles: list[StagedHandle] = []
        self._latest: dict[str, StagedHandle] = {}
        self._lock = threading.Lock()
        self._staging = ClaimedStaging(config.storage_options, config.storage_timeout_s)

    # --- the step hooks (nothing is tracked between saves)
    def before_update(self) -> None:
        pass

    def step_end(self) -> None:
        self.version += 1

    def flush(self) -> None:
        pass

    def save(self, path: str, *, state_fn: Callable[[], Any], max_overlap_steps: int | None = None,
             mode: str | None = None) -> StagedHandle:
        """Save the strategy's checkpoint of this step at ``path`` in the background; collective.

        Returns once the writer has taken what it copies at once (``max_overlap_steps`` and
        ``mode`` are ignored: captured at the request).

        Raises:
            ValueError: ``path`` is not local.
            RuntimeError: the staging directory could not be made, or ``path`` is a directory
                holding other files than a checkpoint of the strategy's format (every rank
                raises; nothing is deleted).
            What the writer raises.
        """
        t0 = perf_counter()
        fs, root = url_to_fs(path, self.config.storage_options)
        if not is_local(fs):
            raise ValueError(f"these checkpoints are written to local paths only, got {path}")
        self._bound_inflight()
        waited = perf_counter() - t0
        target, problem = None, None
        if self.rank == 0:
            try:
                if os.path.ismount(root):
                    # Publishing is one rename in the parent directory; a mount point cannot be.
                    raise ValueError(f"{root} is a mount point: checkpoint into a directory inside it")
                check_save_path(path_key(root), update_latest=False,
                                framework_names=self._framework_names)
                target = LocalTarget(fs, root, staging=self._staging.make(root),
                                     framework_names=self._framework_names)
            except BaseException as e:  # noqa: BLE001 - every rank must reach the broadcast
                problem = f"{type(e).__name__}: {e}"
        stage, problem = self.strategy.broadcast((target.staging if target else None, problem))
        if problem is None and self._group is not None:
            # Every rank must write where rank 0 commits: a directory not shared across nodes
            # would only fail each save after commit_timeout_s.
            blind = [r for r, seen in enumerate(self._gather(os.path.isdir(stage))) if not seen]
            if blind:
                problem = (f"ranks {blind} do not see the staging directory {stage}: the checkpoint "
                           "directory must be on a filesystem every node shares")
        if problem is not None:
            if target is not None:
                target.cleanup(False)
            raise RuntimeError(f"gockpt: checkpoint {path} not taken: {problem}")
        try:
            checkpoint = state_fn()["lightning"]
            written, copied = self._write(stage, checkpoint)
        except BaseException:
            if target is not None:
                target.cleanup(False)
            raise
        stall = perf_counter() - t0
        step = checkpoint.get("global_step", self.version)  # Lightning's optimizer steps
        # "lazy": captured at the request.
        metrics = CheckpointMetrics(path=root, mode="lazy", num_overlap_steps=1, requested_step=step,
                                    captured_step=step, stall_s=stall,
                                    stall_by_phase_s={"slot_wait": waited, "copy": stall - waited},
                                    state_bytes=copied, host_bytes=copied, host_peak_bytes=copied)
        written.add_done_callback(lambda f: mark(stage, self.rank, f))
        outcome: Future[CheckpointMetrics] = Future()
        if self._commits is not None:
            assert target is not None
            outcome = self._commits.submit(self._commit, target, written, metrics, t0)
        else:
            written.add_done_callback(lambda f: _settle(outcome, f, metrics, t0))
        handle = StagedHandle(path, outcome)  # the caller's path: the callback compares it with its own
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]
            self._latest[path] = handle
        return handle

    def _gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _bound_inflight(self) -> None:
        # Each save in flight holds its own host copy: at most max_inflight of them per rank.
        with self._lock:
            pending = [h for h in self._handles if not h.done()]
        while len(pending) >= self.max_inflight:
            try:
                pending[0].result()
            except BaseException:  # noqa: BLE001 - raised by wait(); here only room is awaited
                pass
            pending = pending[1:]

    def _commit(self, target: LocalTarget, written: Future[int], metrics: CheckpointMetrics,
                t0: float) -> CheckpointMetrics:
        # Rank 0's commit thread: every rank's files durable, then one atomic rename.
        published = False
        try:
            own: BaseException | None = None
            try:
                _fill(metrics, written.result(), t0)
            except BaseException as e:  # noqa: BLE001 - raised below, once the others are done
                own = e
            # Every rank's outcome before the staging directory goes, even when this rank's
            # failed: a rank still writing into it would leave part of it behind.
            deadline = monotonic() + self.commit_timeout_s
            errors: list[BaseException] = []
            for r in range(self.world):
                if own is not None and r == self.rank:
                    continue  # this rank's own outcome is known
                try:
                    await_part(target.staging, r, deadline)
                except (RuntimeError, TimeoutError) as e:
                    errors.append(e)
            if own is not None:
                raise own
            if errors:
                raise errors[0]
            for r in range(self.world):
                os.unlink(os.path.join(target.staging, f"{part_name(r)}.done"))
            # Files the strategy wrote itself (DeepSpeed's `latest`, its scripts) were not fsynced.
            for d, _, names in os.walk(target.staging):
                for n in names:
                    fsync_path(os.path.join(d, n))
                fsync_path(d)
            target.publish(b"")
            published = True
            metrics.time_to_durable_s = perf_counter() - t0
            return metrics
        finally:
            target.cleanup(published)
            if not published:
                log.warning("gockpt: checkpoint %s not committed", target.root)

    def wait(self, timeout_s: float | None = None) -> list[CheckpointMetrics]:
        """Finish every pending save (rank 0: committed); collective while the ranks meet.

        Raises:
            The first error of this rank's saves; on the other ranks a ``RuntimeError`` naming
            it, so that no rank waits for one that raised.
        """
        with self._lock:
            handles = list(self._handles)
        out, error = [], None
        try:
            out = [h.result(timeout_s) for h in handles]
        except BaseException as e:  # noqa: BLE001 - raised below, after the ranks have met
            error = e
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()]
        errors = [None if error is None else f"{type(error).__name__}: {error}"]
        if self._group is not None and self._collective():
            errors = self._gather(errors[0])
        if error is not None:
            raise error
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if bad:
            raise RuntimeError("gockpt: a checkpoint failed on another rank: " + "; ".join(bad))
        return out

    def remove(self, path: str) -> None:
        """Delete the checkpoint at ``path`` (rank 0); a save of it in flight first commits."""
        remove_when_done(path, self._latest, self._lock, self.config)

    def close(self) -> None:
        """Finish the pending saves and stop (collective while the ranks meet)."""
        try:
            self.wait()
        finally:
            if self._commits is not None:
                self._commits.shutdown(wait=True)
            close = getattr(self._write, "close", None)
            if close is not None:
                close()
            drain_discards()
            self._staging.release()


def remove_when_done(path: str, latest: dict[str, Any], lock: threading.Lock, config: GoCkptConfig) -> None:
    """Delete the checkpoint at ``path`` now, or once the save of it in flight has ended.

    ``latest`` maps each path to the handle of its newest save (read under ``lock``); a save of
    ``path`` requested again meanwhile is the checkpoint then, and is kept.
    """
    with lock:
        handle = latest.get(path)
    if handle is None or handle.done():
        gockpt.remove_checkpoint(path, config.storage_options, timeout_s=config.storage_timeout_s,
                                 discard=_DELETER)
        return

    def drop(h: Any) -> None:
        with lock:
            if latest.get(path) is not h:
                return  # saved again since: that save is the checkpoint now
        gockpt.remove_checkpoint(path, config.storage_options, timeout_s=config.storage_timeout_s,
                                 discard=_DELETER)

    handle.add_done_callback(drop)


def remove_now(path: str, config: GoCkptConfig) -> None:
    """Delete the checkpoint at ``path``, no save of which is in flight, from any thread: it
    stops being a checkpoint before this returns; its files are deleted in the background
    (:func:`drain_discards` waits for them).

    Raises:
        gockpt.CheckpointStorageError: as :func:`gockpt.remove_checkpoint`.
    """
    gockpt.remove_checkpoint(path, config.storage_options, timeout_s=config.storage_timeout_s,
                             discard=_DELETER)


# One deleter for every engine of the process: removals may happen after an engine closed.
_DELETER = BackgroundDeleter()


def drain_discards() -> None:
    """Wait until the files of every checkpoint removed so far are deleted."""
    _DELETER.drain()


def _fill(metrics: CheckpointMetrics, nbytes: int, t0: float) -> None:
    metrics.persist_bytes = nbytes
    metrics.persist_s = perf_counter() - t0 - metrics.stall_s
    metrics.persist_gbps = nbytes / metrics.persist_s / 1e9 if metrics.persist_s > 0 else 0.0
    metrics.time_to_durable_s = perf_counter() - t0


def _settle(outcome: Future[CheckpointMetrics], written: Future[int], metrics: CheckpointMetrics,
            t0: float) -> None:
    # A rank other than 0: its save is done once its own files are durable.
    try:
        _fill(metrics, written.result(), t0)
    except BaseException as e:  # noqa: BLE001 - delivered through the handle
        outcome.set_exception(e)
        return
    outcome.set_result(metrics)


__all__ = ["COMMIT_TIMEOUT_S", "StagedAdapterEngine", "StagedHandle", "Writer", "drain_discards",
           "remove_when_done"]
